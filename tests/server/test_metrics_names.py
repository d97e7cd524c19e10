"""/metrics speaks vLLM's names and labels (only the prefix differs), every family exists before the
first request, and every query of the Grafana dashboard in examples/ names a metric the server
exports."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from server_helpers import metric

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana.json"
VLLM_FAMILIES = (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
    "generation_tokens_total", "num_preemptions_total", "request_success_total", "iteration_tokens_total_count",
    "time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
    "request_queue_time_seconds_count", "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
    "request_inference_time_seconds_count", "request_time_per_output_token_seconds_count",
    "request_prompt_tokens_count", "request_generation_tokens_count", "cache_config_info",
)


def _sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_vllm_families_and_labels(client):
    text = client.get("/metrics").text
    names = _sample_names(text)
    for family in VLLM_FAMILIES:
        assert f"kdaserve:{family}" in names, family
    for reason in ("stop", "length", "abort"):   # created up front
        assert f'finished_reason="{reason}"' in text
    assert 'engine="0"' in text and "finish_reason=" not in text
    assert "process_resident_memory_bytes" in names


def test_a_request_moves_the_per_request_histograms(client):
    before = client.get("/metrics").text
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    import time

    for _ in range(100):
        after = client.get("/metrics").text
        if metric(after, "kdaserve:request_generation_tokens_count") > metric(before, "kdaserve:request_generation_tokens_count"):
            break
        time.sleep(0.05)
    for name in ("request_queue_time_seconds_count", "request_prefill_time_seconds_count",
                 "request_decode_time_seconds_count", "request_generation_tokens_sum"):
        assert metric(after, f"kdaserve:{name}") > metric(before, f"kdaserve:{name}"), name
    assert metric(after, "kdaserve:request_success_total", finished_reason="length") >= 1


def test_every_dashboard_query_names_an_exported_metric(client):
    names = _sample_names(client.get("/metrics").text)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][0]["query"])
    used = {m for e in exprs for m in re.findall(r"kdaserve:[a-z0-9_]+", e)}
    assert len(used) >= 15
    missing = sorted(m for m in used if m not in names)
    assert not missing, missing


def test_speculative_decoding_exports_vllms_spec_decode_counters():
    """A server with prompt-lookup speculation: a repetitive prompt drafts tokens, and the counters
    (drafts, drafted, accepted, accepted per position) move by what the engine counted."""
    from fastapi.testclient import TestClient
    from server_helpers import MAX_MODEL_LEN

    from kdaserve.engine.llm_engine import LLMEngine
    from kdaserve.server.app import build_app

    engine = LLMEngine("tiny", kda_prefill_backend="reference", kda_decode_backend="reference", max_num_seqs=4,
                       max_model_len=MAX_MODEL_LEN, device="cpu",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1})
    with TestClient(build_app(engine)) as http:
        body = {"model": engine.model_name, "prompt": "abcabcabcabcabcabc", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 12
        stats = engine.stats()   # final: the engine counted before it delivered the last token
        assert stats["spec_decode_num_draft_tokens"] > 0

        def exported(text):
            return [metric(text,
                           f"kdaserve:spec_decode_{n}_total") for n in ("num_drafts", "num_draft_tokens",
                                                                        "num_accepted_tokens")] \
                + [metric(text, "kdaserve:spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in range(2)]

        want = [stats[f"spec_decode_{n}"] for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")] \
            + stats["spec_decode_num_accepted_tokens_per_pos"]
        deadline = time.monotonic() + 20   # the gauges refresh right after the step that delivered
        while exported(http.get("/metrics").text) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        assert exported(http.get("/metrics").text) == want


def test_score_only_requests_generate_no_tokens_in_the_metrics(client):
    """echo + max_tokens 0 scores a prompt; the one token the engine samples to do it is hidden
    from the answer, and from generation_tokens and the generated-tokens histogram too."""
    def snapshot():
        text = client.get("/metrics").text
        return (metric(text, "kdaserve:generation_tokens_total"), metric(text, "kdaserve:request_generation_tokens_sum"),
                metric(text, "kdaserve:request_success_total", finished_reason="length"),
                metric(text, "kdaserve:prompt_tokens_total"))

    before = snapshot()
    body = {"model": "tiny", "prompt": "Score this text", "max_tokens": 0, "echo": True, "logprobs": 0}
    assert client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 0
    deadline = time.monotonic() + 20
    while snapshot()[2] == before[2] and time.monotonic() < deadline:   # until the request is counted finished
        time.sleep(0.02)
    after = snapshot()
    assert after[2] == before[2] + 1 and after[3] > before[3]
    assert after[0] == before[0] and after[1] == before[1], (before, after)


_OBSERVE_MANY_CHECK = """
import math
from prometheus_client import CollectorRegistry, Histogram
from kdaserve.server.metrics import observe_many
values = [0.001, 0.0012, 0.0012, 0.005, 0.03, 0.03, 1e-9, -0.5, 80.0, 81.0, math.inf, 0.0]
registry = CollectorRegistry()
one = Histogram("one_seconds", "d", ["m"], buckets=(0.001, 0.0025, 0.005, 0.03, 80.0), registry=registry).labels(m="x")
many = Histogram("many_seconds", "d", ["m"], buckets=(0.001, 0.0025, 0.005, 0.03, 80.0), registry=registry).labels(m="x")
for v in values:
    one.observe(v)
observe_many(many, values[:5])
observe_many(many, values[5:])
def samples(name):
    if MULTIPROCESS:
        from prometheus_client import multiprocess
        registry_ = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry_)
    else:
        registry_ = registry
    return sorted((s.name.replace(name, ""), tuple(sorted(s.labels.items())), s.value)
                  for m in registry_.collect() if m.name == name for s in m.samples if not s.name.endswith("_created"))
assert samples("one_seconds") == samples("many_seconds") and len(samples("one_seconds")) >= 8, samples("one_seconds")
print("ok")
"""


@pytest.mark.parametrize("multiprocess", [False, True])
def test_observing_many_values_at_once_equals_observing_each(tmp_path, multiprocess):
    """observe_many (a step's inter-token latencies in one update per bucket) leaves a histogram
    exactly as one observe per value would: bucket edges, values past every bound, the sum; in
    prometheus_client's multiprocess mode too (--api-server-count > 1), run in a process of its
    own since that mode is chosen when prometheus_client is imported."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if multiprocess:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", f"MULTIPROCESS = {multiprocess}\n" + _OBSERVE_MANY_CHECK], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
