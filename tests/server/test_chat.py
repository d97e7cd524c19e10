"""/v1/chat/completions over real HTTP: template, token budgets, log-probs, streaming, usage."""

from __future__ import annotations

from server_helpers import greedy, sse_events

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def chat(client, **body) -> dict:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_answer_usage_and_budgets(client):
    prompt_tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    out = chat(client, **greedy(messages=MESSAGES, max_tokens=4))
    assert out["object"] == "chat.completion"
    (choice,) = out["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4, "total_tokens": prompt_tokens + 4}
    # max_completion_tokens wins over max_tokens; content parts are text.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    out = chat(client, **greedy(messages=[MESSAGES[0], *parts], max_tokens=9, max_completion_tokens=2))
    assert out["usage"]["completion_tokens"] == 2 and out["usage"]["prompt_tokens"] == prompt_tokens


def test_chat_logprobs(client):
    out = chat(client, **greedy(messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2))
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert entry["logprob"] >= max(t["logprob"] for t in entry["top_logprobs"]) - 1e-5


def test_chat_streaming(client):
    body = greedy(messages=MESSAGES, max_tokens=4)
    whole = chat(client, **body)["choices"][0]["message"]["content"]
    events = sse_events(client, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
    token_events = events[:-2]
    # A chunk per step's new tokens (merged when the handler fell behind, as in vLLM).
    assert 1 <= len(token_events) <= 4 and all(e["object"] == "chat.completion.chunk" for e in token_events)
    deltas = [e["choices"][0]["delta"] for e in token_events]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == whole
    assert [e["choices"][0]["finish_reason"] for e in token_events] == [None] * (len(token_events) - 1) + ["length"]


def test_prompt_logprobs_in_vllm_form_for_chat_and_completions(client):
    """vLLM's prompt_logprobs field: chat answers one top-level list, completions one per choice;
    None for the first token, then {token id: {logprob, rank, decoded_token}} holding the prompt's
    own token (its true rank) and the top alternatives, the same numbers as echo's log-probs."""
    ids = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    out = chat(client, **greedy(messages=MESSAGES, max_tokens=1, prompt_logprobs=2))
    rows = out["prompt_logprobs"]
    assert len(rows) == len(ids) == out["usage"]["prompt_tokens"] and rows[0] is None
    echo = client.post("/v1/completions", json=greedy(prompt=ids, max_tokens=1, echo=True, logprobs=2)).json()
    echo_lp = echo["choices"][0]["logprobs"]["token_logprobs"]
    done = client.post("/v1/completions", json=greedy(prompt=ids, max_tokens=1, prompt_logprobs=2)).json()
    assert done["choices"][0]["prompt_logprobs"] == rows
    for token, row, want in zip(ids[1:], rows[1:], echo_lp[1:]):
        own = row[str(token)]
        assert abs(own["logprob"] - want) < 1e-5 and own["rank"] >= 1
        others = sorted(row.values(), key=lambda v: -v["logprob"])
        assert 2 <= len(row) <= 3 and all(v["logprob"] <= 0 for v in others)
        assert own["rank"] == 1 + sum(v["logprob"] > own["logprob"] for v in others if v is not own) or own["rank"] > 2
    for body in (dict(messages=MESSAGES, prompt_logprobs=1, stream=True), dict(messages=MESSAGES, prompt_logprobs=-1)):
        r = client.post("/v1/chat/completions", json=greedy(max_tokens=1, **body))
        assert r.status_code == 400, r.text
