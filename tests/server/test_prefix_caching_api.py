"""Prefix caching through the server: usage.prompt_tokens_details.cached_tokens with
--enable-prompt-tokens-details, and vLLM's prefix-cache counters in /metrics."""

from __future__ import annotations

import pytest
from server_helpers import MAX_MODEL_LEN, MAX_NUM_SEQS, greedy, metric

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def cached_client():
    from kdaserve.engine.llm_engine import LLMEngine
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    engine = LLMEngine("tiny", kda_prefill_backend="reference", kda_decode_backend="reference", max_num_seqs=MAX_NUM_SEQS,
                       max_model_len=MAX_MODEL_LEN, device="cpu", enforce_eager=True, enable_prefix_caching=True,
                       mamba_block_size=32)
    with BackgroundServer(build_app(engine, enable_prompt_tokens_details=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def test_cached_tokens_in_usage_and_metrics(cached_client):
    system = "You are a terse assistant. " * 6          # 162 characters: 162 byte tokens
    first = cached_client.post("/v1/completions", json=greedy(prompt=system + "Q1", max_tokens=2)).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = cached_client.post("/v1/completions", json=greedy(prompt=system + "Q2?", max_tokens=2, n=2)).json()
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 160}, "counted once for its n choices"
    chat = cached_client.post("/v1/chat/completions", json=greedy(messages=[{"role": "user", "content": system + "Q3"}],
                                                                  max_tokens=2)).json()
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "the chat template's prefix differs"
    text = cached_client.get("/metrics").text
    assert metric(text, "kdaserve:prefix_cache_hits_total") >= 160
    assert metric(text, "kdaserve:prefix_cache_queries_total") >= metric(text, "kdaserve:prefix_cache_hits_total") + 164
    assert 'enable_prefix_caching="True"' in text


def test_no_prompt_tokens_details_by_default(client):
    body = client.post("/v1/completions", json=greedy(prompt="Hello", max_tokens=1)).json()
    assert "prompt_tokens_details" not in body["usage"]
    text = client.get("/metrics").text
    assert metric(text, "kdaserve:prefix_cache_queries_total") > 0, "prefix caching is on by default"


def test_counters_exist_with_caching_off():
    from kdaserve.server.metrics import ServerMetrics

    text = ServerMetrics("m", cache_info={"enable_prefix_caching": False}).render().decode()
    assert "kdaserve:prefix_cache_queries_total{" in text and "kdaserve:prefix_cache_hits_total{" in text


def test_cache_salt_field(cached_client):
    body = greedy(prompt="Salted prompt, long enough to span two checkpoints. " * 2, max_tokens=1, cache_salt="t1")
    cached_client.post("/v1/completions", json=body)
    again = cached_client.post("/v1/completions", json=body).json()
    other = cached_client.post("/v1/completions", json={**body, "cache_salt": "t2"}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = cached_client.post("/v1/completions", json={**body, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
