"""Prometheus metrics served at `/metrics`.

Names follow vLLM's (`vllm:num_requests_running` -> `kdaserve:num_requests_running`) so existing
dashboards and benchmark scrapers need only the prefix changed. Each server owns its own registry,
so several servers (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# engine.stats() key -> gauge attribute; the first key present wins.
_STAT_KEYS = {
    "num_requests_running": ("num_running", "num_requests_running"),
    "num_requests_waiting": ("num_waiting", "num_requests_waiting"),
    "state_slots_used": ("state_slots_used", "num_state_slots_used", "slots_used"),
    "state_slots_total": ("state_slots_total", "num_state_slots", "slots_total"),
    "kv_blocks_used": ("kv_blocks_used", "num_kv_blocks_used"),
    "kv_blocks_total": ("kv_blocks_total", "num_kv_blocks"),
}


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"kdaserve:{name}", doc, registry=r, labelnames=("model_name",)).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.state_slots_used = gauge("state_slots_used", "KDA recurrent-state cache slots in use.")
        self.state_slots_total = gauge("state_slots_total", "KDA recurrent-state cache slots in all.")
        self.kv_blocks_used = gauge("kv_blocks_used", "Paged KV-cache blocks in use (full-attention layers).")
        self.kv_blocks_total = gauge("kv_blocks_total", "Paged KV-cache blocks in all.")
        self.prompt_tokens = Counter(
            "kdaserve:prompt_tokens", "Prompt tokens admitted.", labelnames=("model_name",), registry=r
        ).labels(**labels)
        self.generation_tokens = Counter(
            "kdaserve:generation_tokens", "Tokens generated.", labelnames=("model_name",), registry=r
        ).labels(**labels)
        self._finished = Counter(
            "kdaserve:request_success",
            "Requests finished, by finish reason (stop, length, abort).",
            labelnames=("model_name", "finish_reason"),
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "kdaserve:time_to_first_token_seconds",
            "Arrival to first generated token.",
            labelnames=("model_name",),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.time_per_output_token = Histogram(
            "kdaserve:time_per_output_token_seconds",
            "Mean time between output tokens of a finished request (after its first token).",
            labelnames=("model_name",),
            buckets=_TPOT_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.e2e_latency = Histogram(
            "kdaserve:e2e_request_latency_seconds",
            "Arrival to the last token.",
            labelnames=("model_name",),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self._model_name = model_name

    @property
    def finished_requests(self):
        return _FinishedByReason(self._finished, self._model_name)

    def update_from_stats(self, stats: dict) -> None:
        for attr, keys in _STAT_KEYS.items():
            for key in keys:
                if key in stats and stats[key] is not None:
                    getattr(self, attr).set(stats[key])
                    break

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FinishedByReason:
    def __init__(self, counter: Counter, model_name: str):
        self._counter = counter
        self._model_name = model_name

    def labels(self, *, finish_reason: str):
        return self._counter.labels(model_name=self._model_name, finish_reason=finish_reason)
