"""Bad input gets a 400 with an OpenAI-style error, never a 5xx: loose types, lone surrogates,
JSON nested 1,000 deep, unbounded stop strings, stream_options without stream, invalid token ids."""

from __future__ import annotations

import re

import pytest

from kdaserve.server.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS


def _error(r, status=400):
    assert r.status_code == status, (r.status_code, r.text[:300])
    return r.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [("prompt", [True]), ("stream", "yes"), ("max_tokens", "5"),
                                          ("temperature", "0.5"), ("n", 1.5), ("echo", 1)])
def test_loose_types_are_refused(client, field, value):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, field: value}
    assert field in _error(client.post("/v1/completions", json=body))
    ok = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0}   # an int is a valid float
    assert client.post("/v1/completions", json=ok).status_code == 200


def test_lone_surrogates_and_deep_nesting_are_400s(client):
    raw = b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'
    r = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert "surrogate" in _error(r)
    deep = b'{"model": "tiny", "prompt": "x", "extra": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    r = client.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 or r.status_code == 200, r.text        # parsed and the extra field ignored, or refused
    deeper = b'{"model": "tiny", "prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/v1/completions", content=deeper, headers={"Content-Type": "application/json"})
    assert "nested too deeply" in _error(r)


def test_stop_strings_are_bounded(client):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    assert f"at most {MAX_STOP_STRINGS} stop strings" in _error(client.post("/v1/completions", json={**body, "stop": many}))
    long = "x" * (MAX_STOP_STRING_CHARS + 1)
    assert "characters" in _error(client.post("/v1/completions", json={**body, "stop": [long]}))
    assert client.post("/v1/completions", json={**body, "stop": many[:MAX_STOP_STRINGS]}).status_code == 200


def test_stream_options_need_stream(client):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert "stream_options" in _error(client.post("/v1/completions", json=body))


def test_detokenize_refuses_ids_outside_the_vocabulary(client):
    assert "not in the vocabulary" in _error(client.post("/detokenize", json={"tokens": [72, 10**9]}))
    assert "not in the vocabulary" in _error(client.post("/detokenize", json={"tokens": [-1]}))
    assert client.post("/detokenize", json={"tokens": [72, 105]}).json()["prompt"] == "Hi"


def test_a_long_prompt_is_refused_by_its_character_count(client):
    """Over max_model_len x 64 characters: 400 without tokenizing (the tokenizer never sees it)."""
    from server_helpers import MAX_MODEL_LEN

    from kdaserve.server.serving import MAX_CHARS_PER_TOKEN

    text = "x" * (MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN + 1)
    assert "characters" in _error(client.post("/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 2}))
    assert "characters" in _error(client.post("/tokenize", json={"prompt": text}))


def test_a_huge_prompt_is_refused_quickly_while_health_answers(server, client):
    """20 MB of text: refused (413, past the default body limit) in well under a second; /health
    answers meanwhile in under 100 ms. The 20 MB come from another process: a client thread in
    this one would hold the GIL the server's event loop needs, timing the test, not the server."""
    import json
    import subprocess
    import sys
    import time

    sender = (
        "import json, sys, time, httpx\n"
        "raw = b'{\"model\": \"tiny\", \"max_tokens\": 2, \"prompt\": \"' + b'x' * 20_000_000 + b'\"}'\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
        "with httpx.Client(base_url=sys.argv[1], timeout=60) as c:\n"
        "    start = time.monotonic()\n"
        "    r = c.post('/v1/completions', content=raw, headers={'Content-Type': 'application/json'})\n"
        "    print(json.dumps({'status': r.status_code, 'seconds': time.monotonic() - start}), flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", sender, server.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"   # the 20 MB body is built before timing starts
    proc.stdin.write("go\n")
    proc.stdin.flush()
    health = []
    while proc.poll() is None:
        start = time.monotonic()
        assert client.get("/health").status_code == 200
        health.append(time.monotonic() - start)
        time.sleep(0.01)
    result = json.loads(proc.stdout.readline())
    assert result["status"] == 413 and result["seconds"] < 1.0, result
    assert max(health, default=0) < 0.1, health


def test_405_says_which_methods_are_allowed(client):
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers.get("allow", ""), (r.status_code, dict(r.headers))


def test_a_request_that_can_never_be_admitted_is_a_400(server, client):
    limit = server.app.state.server.engine_loop.max_in_flight
    prompts = limit // 16 + 1                   # prompts x n = more than the server ever admits
    body = {"model": "tiny", "prompt": ["a"] * prompts, "n": 16, "max_tokens": 1}
    assert "admits at most" in _error(client.post("/v1/completions", json=body))


@pytest.mark.parametrize("extra, message", [
    ({"best_of": 3}, "best_of=3 is not supported"),
    ({"suffix": "end"}, "suffix is not supported"),
    ({"response_format": {"type": "structural_tag"}}, "structural_tag is not supported"),
    # Completions: tools belong to chat; chat: "auto" needs a tool-call parser this server lacks.
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs needs exactly one"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"presence_penalty": 5}, "presence_penalty: got 5.0; expected a number in"),
    ({"min_tokens": 50}, r"min_tokens: got 50; expected an integer in \[0, max_tokens=2\]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
])
def test_fields_not_built_or_out_of_range_are_refused_not_ignored(client, extra, message):
    """Fields a client sends are applied or refused with the reason, never silently dropped."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, **extra}
    err = _error(client.post("/v1/completions", json=body))
    assert re.search(message, err), err
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    if "best_of" not in extra and "suffix" not in extra:   # completions-only fields
        assert re.search(message, _error(client.post("/v1/chat/completions", json=chat)))


def test_defaults_of_the_refused_fields_are_accepted(client):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "best_of": 1, "suffix": None, "tool_choice": "none",
            "response_format": {"type": "text"}, "presence_penalty": 0, "logit_bias": {}}
    assert client.post("/v1/completions", json=body).status_code == 200


def test_oversized_requests_are_refused_by_counting_before_validation(client):
    """A million-entry logit_bias would take seconds and hundreds of MiB to validate before its 400,
    10,000 prompts x n=16 as long: both are counted first. A 5,000-digit token id is a plain 400, not Python's
    integer-conversion message."""
    import json
    import time

    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    json_header = {"Content-Type": "application/json"}
    # Encoded before the clock starts: the bound is on the server's work, not the client's JSON.
    huge_bias = json.dumps({**body, "logit_bias": {str(i): 1 for i in range(1_000_000)}})
    many = json.dumps({**body, "prompt": ["Hi"] * 10_000, "n": 16})
    t0 = time.monotonic()
    assert "at most 1024 logit_bias entries are allowed, got 1000000" in _error(
        client.post("/v1/completions", content=huge_bias, headers=json_header))
    r = client.post("/v1/completions", content=many, headers=json_header)
    assert r.status_code == 400 and "this request holds 160000 sequences (prompts x n)" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5
    message = _error(client.post("/v1/completions", json={**body, "logit_bias": {"9" * 5000: 1}}))
    assert "token ids (integers >= 0)" in message and "digits" not in message
    assert "at most 1024 stop token ids" in _error(
        client.post("/v1/completions", json={**body, "stop_token_ids": list(range(2000))}))
