"""vLLM's per-request `metrics` in responses: only with --enable-per-request-metrics (timing),
only for a single sequence, on the final usage chunk of a stream."""

from __future__ import annotations

import pytest
from server_helpers import greedy, make_engine, sse_events

httpx = pytest.importorskip("httpx")

KEYS = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}


@pytest.fixture(scope="module")
def metrics_client():
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    with BackgroundServer(build_app(make_engine(), enable_per_request_metrics=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def test_timing_metrics_in_a_response(metrics_client):
    body = metrics_client.post("/v1/completions", json=greedy(prompt="Hello", max_tokens=6)).json()
    m = body["metrics"]
    assert set(m) == KEYS
    assert m["time_to_first_token_ms"] >= 0 and m["queue_time_ms"] >= 0 and m["generation_time_ms"] >= 0
    assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / 5)
    assert m["tokens_per_second"] > 0
    chat = metrics_client.post("/v1/chat/completions", json=greedy(messages=[{"role": "user", "content": "Hi"}],
                                                                    max_tokens=3)).json()
    assert set(chat["metrics"]) == KEYS


def test_metrics_ride_on_the_final_usage_chunk(metrics_client):
    events = sse_events(metrics_client, "/v1/completions", greedy(prompt="Hello", max_tokens=4, stream=True,
                                                                  stream_options={"include_usage": True}))
    assert set(events[-2]["metrics"]) == KEYS and events[-2]["usage"]["completion_tokens"] == 4
    assert all("metrics" not in e for e in events[:-2])


def test_no_metrics_for_several_sequences_or_by_default(metrics_client, client):
    body = metrics_client.post("/v1/completions", json=greedy(prompt="Hello", max_tokens=2, n=2)).json()
    assert "metrics" not in body
    assert "metrics" not in client.post("/v1/completions", json=greedy(prompt="Hello", max_tokens=2)).json()
