"""/v1/completions over real HTTP: answers, streaming, usage, echo + log-probs, stop strings, prompt forms."""

from __future__ import annotations

import math

from server_helpers import MAX_MODEL_LEN, greedy, sse_events

PROMPT = "The quick brown fox"


def complete(client, **body) -> dict:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_and_health(client):
    assert client.get("/health").status_code == 200
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny"]
    assert data[0]["root"] == "tiny" and data[0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"


def test_completion_answer_and_usage(client):
    tokens = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = complete(client, **greedy(prompt=PROMPT, max_tokens=5))
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": len(tokens), "completion_tokens": 5, "total_tokens": len(tokens) + 5}
    # Greedy is deterministic, and the text is what the tokens decode to.
    again = complete(client, **greedy(prompt=PROMPT, max_tokens=5))
    assert again["choices"][0]["text"] == choice["text"]


def test_streaming_equals_non_streaming(client):
    body = greedy(prompt=PROMPT, max_tokens=5, return_token_ids=True)
    whole = complete(client, **body)["choices"][0]
    events = sse_events(client, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_event = events[-2]
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 5
    token_events = events[:-2]
    # A message per step's new tokens (several steps' when the handler fell behind: merged, as in
    # vLLM); finish_reason only on the last.
    assert 1 <= len(token_events) <= 5 and all(e["choices"][0]["token_ids"] for e in token_events)
    assert [e["choices"][0]["finish_reason"] for e in token_events] == [None] * (len(token_events) - 1) + ["length"]
    assert "".join(e["choices"][0]["text"] for e in token_events) == whole["text"]
    assert sum((e["choices"][0]["token_ids"] for e in token_events), []) == whole["token_ids"]
    # Without include_usage: no usage message at all.
    plain = sse_events(client, "/v1/completions", {**body, "stream": True})
    assert plain[-1] == "[DONE]" and all(e == "[DONE]" or e["choices"] for e in plain)
    assert all("usage" not in e for e in plain[:-1])


def test_echo_with_logprobs_agrees_with_generation(client):
    """Generate greedily with log-probs, then score prompt + generation with echo: the echoed
    log-probs of the generated tokens must equal the ones reported while generating."""
    prompt_ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    gen = complete(client, **greedy(prompt=prompt_ids, max_tokens=4, logprobs=2, return_token_ids=True))
    lp = gen["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and all(v <= 0 for v in lp["token_logprobs"])
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 3  # top 2, plus the chosen token when outside them
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)  # greedy picks the most likely
    generated_ids = gen["choices"][0]["token_ids"]
    assert gen["choices"][0]["prompt_token_ids"] == prompt_ids and len(generated_ids) == 4

    scored = complete(client, **greedy(prompt=prompt_ids + generated_ids, max_tokens=1, logprobs=1, echo=True))
    slp = scored["choices"][0]["logprobs"]
    n_prompt = len(prompt_ids) + len(generated_ids)
    assert len(slp["tokens"]) == n_prompt + 1
    assert slp["token_logprobs"][0] is None and slp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in slp["token_logprobs"][1:])
    echoed = slp["token_logprobs"][len(prompt_ids) : n_prompt]
    assert all(math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3) for a, b in zip(echoed, lp["token_logprobs"])), (echoed, lp)
    assert scored["choices"][0]["text"].startswith(PROMPT + gen["choices"][0]["text"])
    assert scored["usage"]["prompt_tokens"] == n_prompt
    offsets = slp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_echo_streams_prompt_first(client):
    events = sse_events(client, "/v1/completions", {**greedy(prompt=PROMPT, max_tokens=2), "echo": True, "stream": True})
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert texts[0].startswith(PROMPT) and len(texts) in (1, 2)   # one when the two steps were merged


def test_stop_string(client):
    text = complete(client, **greedy(prompt=PROMPT, max_tokens=12))["choices"][0]["text"]
    assert len(text) >= 4, repr(text)
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the middle
    expected = text[: text.index(stop)]
    out = complete(client, **greedy(prompt=PROMPT, max_tokens=12, stop=[stop, "never-generated"]))
    assert out["choices"][0]["text"] == expected and out["choices"][0]["finish_reason"] == "stop"
    events = sse_events(client, "/v1/completions", {**greedy(prompt=PROMPT, max_tokens=12, stop=stop), "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_prompt_forms(client):
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = complete(client, **greedy(prompt=PROMPT, max_tokens=3))["choices"][0]["text"]
    assert complete(client, **greedy(prompt=ids, max_tokens=3))["choices"][0]["text"] == by_text
    many = complete(client, **greedy(prompt=[ids, ids[:3]], max_tokens=3))
    assert [c["index"] for c in many["choices"]] == [0, 1]
    assert many["choices"][0]["text"] == by_text
    assert many["usage"]["prompt_tokens"] == len(ids) + 3 and many["usage"]["completion_tokens"] == 6
    strings = complete(client, **greedy(prompt=[PROMPT, "Hi"], max_tokens=2))
    assert len(strings["choices"]) == 2 and strings["choices"][0]["text"] == by_text[: len(strings["choices"][0]["text"])]


def test_sampling_is_seeded_and_unknown_fields_are_ignored(client):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 7,
            "ignore_eos": True, "user": "someone", "presence_penalty": 0.0, "not_a_field": {"x": 1}}
    first, second = complete(client, **body), complete(client, **body)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == 6


def test_tokenize_detokenize(client):
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == MAX_MODEL_LEN
    assert client.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == PROMPT
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


def test_scoring_only_with_max_tokens_zero(client):
    """Evaluation harnesses score a text with echo + logprobs and no generation."""
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = complete(client, **greedy(prompt=PROMPT, max_tokens=0, echo=True, logprobs=0))
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    events = sse_events(client, "/v1/completions", {**greedy(prompt=PROMPT, max_tokens=0, echo=True), "stream": True})
    assert [e["choices"][0]["text"] for e in events[:-1]] == [PROMPT]


def test_n_choices_per_prompt(client):
    out = complete(client, prompt=PROMPT, max_tokens=3, n=2, temperature=1.0, seed=3, ignore_eos=True)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    prompt_tokens = client.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6, "total_tokens": prompt_tokens + 6}


def test_top_logprobs_keep_every_alternative_when_texts_collide():
    """Byte tokens of a split character all decode to U+FFFD: keyed by text, three alternatives
    became two, and the chosen token could show another token's value. The chosen token keeps its
    text and its exact token_logprobs value; the others whose text is taken are keyed by id."""
    from types import SimpleNamespace

    from kdaserve.server.completions import ChoiceLogprobs

    texts = {5: "\ufffd", 6: "\ufffd", 7: "a", 8: "\ufffd"}
    state = SimpleNamespace(token_text=lambda t: texts[t])
    lp = ChoiceLogprobs(state)
    lp.add(6, {"logprob": -1.5, "top": [(5, -0.5), (7, -1.0), (6, -1.5)]})     # chosen third, shares 5's text
    lp.add(8, {"logprob": -4.0, "top": [(5, -0.2), (6, -0.9), (7, -1.1)]})     # chosen outside the top 3
    first, second = lp.as_dict()["top_logprobs"]
    assert first == {"token_id:5": -0.5, "a": -1.0, "\ufffd": -1.5} and len(first) == 3
    assert second == {"token_id:5": -0.2, "token_id:6": -0.9, "a": -1.1, "\ufffd": -4.0}
    assert [top[text] for top, text in zip((first, second), lp.as_dict()["tokens"])] == lp.as_dict()["token_logprobs"]
    by_id = ChoiceLogprobs(SimpleNamespace(token_text=lambda t: f"token_id:{t}"))   # --return-tokens-as-token-ids
    by_id.add(6, {"logprob": -1.5, "top": [(5, -0.5), (7, -1.0), (6, -1.5)]})
    assert by_id.as_dict()["top_logprobs"][0] == {"token_id:5": -0.5, "token_id:7": -1.0, "token_id:6": -1.5}


def test_logit_processors_reach_the_engine(client):
    """logit_bias (JSON keys are strings), min_tokens and the penalties travel to the sampler."""
    forced = complete(client, **greedy(prompt="Hello", max_tokens=4, logit_bias={"77": 100}, return_token_ids=True))
    assert forced["choices"][0]["token_ids"] == [77] * 4
    held = complete(client, **greedy(prompt="Hello", max_tokens=6, logit_bias={"77": 100}, stop_token_ids=[77],
                                     min_tokens=2, return_token_ids=True))
    ids = held["choices"][0]["token_ids"]
    assert 77 not in ids[:2] and len(ids) == 3 and held["choices"][0]["finish_reason"] == "stop"
    penalized = complete(client, **greedy(prompt="Hello", max_tokens=4, logit_bias={"77": 100}, repetition_penalty=100.0,
                                          frequency_penalty=2.0, presence_penalty=2.0, min_p=0.5, return_token_ids=True))
    assert penalized["choices"][0]["token_ids"][0] == 77   # the first 77 is not yet penalized


def test_stream_interval_batches_tokens_into_chunks(client):
    """vLLM's request field: the first token at once, then chunks of at least 3 tokens (a chunk
    may merge more where the handler fell behind), the last with what is left; the same tokens and
    text as without streaming. Without `stream` it changes nothing; below 1 it is a 400."""
    body = greedy(prompt=PROMPT, max_tokens=10, return_token_ids=True)
    whole = complete(client, **body)["choices"][0]
    events = sse_events(client, "/v1/completions", {**body, "stream": True, "stream_interval": 3})
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert len(chunks) <= 4 and all(len(c["token_ids"]) >= 3 for c in chunks[1:-1])
    assert sum((c["token_ids"] for c in chunks), []) == whole["token_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"] and chunks[-1]["finish_reason"] == "length"
    assert complete(client, **body, stream_interval=3)["choices"][0]["text"] == whole["text"]
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_interval": 0})
    assert r.status_code == 400 and "stream_interval" in r.text
