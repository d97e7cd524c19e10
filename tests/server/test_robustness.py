"""The server under stress and abuse: many concurrent streams, disconnects, bad requests, a full
queue, and metrics; after each, the next request must still succeed."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, greedy, metric

OK_BODY = greedy(prompt="Hello", max_tokens=2)


def assert_still_serving(client):
    response = client.post("/v1/completions", json=OK_BODY)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def wait_for_metrics(client, predicate, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = client.get("/metrics").text
        if predicate(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never satisfied the condition:\n{text}")
        time.sleep(0.05)


def idle(text: str) -> bool:
    return (
        metric(text, "kdaserve:num_requests_running") == 0
        and metric(text, "kdaserve:num_requests_waiting") == 0
        and metric(text, "kdaserve:state_slots_used") == 0
    )


def aborted(text: str) -> float:
    return metric(text, "kdaserve:request_success_total", finished_reason="abort")


def test_64_concurrent_streams_complete_with_exact_token_counts(server, client):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, int, int, str | None]:
        max_tokens = 2 + i % 4
        body = {**greedy(prompt=f"request {i}:", max_tokens=max_tokens), "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        streamed_tokens, usage, finish = 0, None, None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event["choices"]:   # a chunk per step, or per several when merged
                    streamed_tokens += len(event["choices"][0]["token_ids"])
                    finish = event["choices"][0]["finish_reason"] or finish
                else:
                    usage = event["usage"]
        return max_tokens, streamed_tokens, usage["completion_tokens"], finish

    async def all_of_them():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(64))), timeout=150)

    results = asyncio.run(all_of_them())
    assert len(results) == 64
    for max_tokens, streamed_tokens, completion_tokens, finish in results:
        assert (streamed_tokens, completion_tokens, finish) == (max_tokens, max_tokens, "length")
    wait_for_metrics(client, idle)


def test_streaming_disconnect_aborts_and_frees_the_slot(server, client):
    before = aborted(client.get("/metrics").text)
    body = {**greedy(prompt="Tell me a long story", max_tokens=MAX_MODEL_LEN - 32), "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as other:
        with other.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # one token arrived; now hang up
    text = wait_for_metrics(client, lambda t: idle(t) and aborted(t) == before + 1)
    assert aborted(text) == before + 1
    assert_still_serving(client)


def test_non_streaming_disconnect_aborts_and_frees_the_slot(server, client):
    before = aborted(client.get("/metrics").text)
    payload = json.dumps(greedy(prompt="Tell me a long story", max_tokens=MAX_MODEL_LEN - 32)).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        wait_for_metrics(client, lambda t: metric(t, "kdaserve:num_requests_running") >= 1)
    wait_for_metrics(client, lambda t: idle(t) and aborted(t) == before + 1)
    assert_still_serving(client)


BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": "x" * (MAX_MODEL_LEN + 1)}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, 10**9]}, None),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "seed": 2**64}, "seed"),   # once failed the whole engine step (500 for everyone)
    ({}, "prompt"),
]


@pytest.mark.parametrize("body,word", BAD_COMPLETIONS, ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_invalid_completion_requests_get_400_json(client, body, word):
    for stream in (False, True):
        response = client.post("/v1/completions", json={**body, "stream": stream})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if word:
            assert word in error["message"], error
    assert_still_serving(client)


def test_malformed_json_unknown_model_and_routes(client):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and "error" in response.json()
    response = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    response = client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 404
    assert client.get("/v1/models/gpt-4").status_code == 404
    response = client.get("/v1/nothing-here")
    assert response.status_code == 404 and "error" in response.json()
    for bad_chat in (
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]},
    ):
        response = client.post("/v1/chat/completions", json=bad_chat)
        assert response.status_code == 400, (bad_chat, response.text)
    assert_still_serving(client)


def test_full_queue_gets_503(server, client):
    engine_loop = server.app.state.server.engine_loop
    limit = engine_loop.max_in_flight
    engine_loop.num_in_flight += limit          # as if the queue were full of other requests
    try:
        response = client.post("/v1/completions", json=OK_BODY)
        assert response.status_code == 503 and response.json()["error"]["code"] == "queue_full"
        assert response.headers["retry-after"] == "1"
    finally:
        engine_loop.num_in_flight -= limit
    assert_still_serving(client)


def test_metrics_count_tokens_and_latencies(client):
    before = client.get("/metrics").text
    assert_still_serving(client)
    after = wait_for_metrics(client, idle)
    assert metric(after, "kdaserve:generation_tokens_total") >= metric(before, "kdaserve:generation_tokens_total") + 2
    assert metric(after, "kdaserve:prompt_tokens_total") >= metric(before, "kdaserve:prompt_tokens_total") + 5
    for name in ("kdaserve:time_to_first_token_seconds_count", "kdaserve:request_time_per_output_token_seconds_count",
                 "kdaserve:inter_token_latency_seconds_count", "kdaserve:request_queue_time_seconds_count",
                 "kdaserve:iteration_tokens_total_count"):
        assert metric(after, name) >= metric(before, name) + 1, name
    assert metric(after, "kdaserve:state_slots_total") > 0


class FailNextStep:
    """Make the engine's next step raise (once), as a bug or a device error would: in this process
    by replacing its step, in its own process through the flag file its step watches."""

    def __init__(self, server):
        self.server = server
        self.engine = server.app.state.server.engine_loop.engine

    def __enter__(self):
        if self.server.mode == "process":
            self.server.fail_flag.touch()
            return self

        def failing_step():
            del self.engine.step  # back to the real method for the steps after this one
            raise RuntimeError("injected step failure")

        self.engine.step = failing_step
        return self

    def __exit__(self, *exc):
        if self.server.mode != "process":
            self.engine.__dict__.pop("step", None)


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(server, client):
    with FailNextStep(server):
        response = client.post("/v1/completions", json=OK_BODY)
    assert response.status_code == 500 and "injected step failure" in response.json()["error"]["message"]
    wait_for_metrics(client, idle)
    assert_still_serving(client)

    body = {**greedy(prompt="A long one", max_tokens=MAX_MODEL_LEN - 32), "stream": True}
    events = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break  # streaming has begun: the status line is sent, errors now travel in-band
        with FailNextStep(server):
            events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "injected step failure" in json.loads(events[-2])["error"]["message"]
    wait_for_metrics(client, idle)
    assert_still_serving(client)
