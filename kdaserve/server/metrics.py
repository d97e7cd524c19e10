"""Prometheus metrics served at `/metrics`, under vLLM's names, labels and meanings: only the
prefix differs (`vllm:num_requests_running` -> `kdaserve:num_requests_running`), so dashboards
and scrapers made for vLLM need the prefix changed and nothing else (examples/grafana.json).

Every family carries `model_name` and `engine` ("0": one engine per server); finished requests
are counted by `finished_reason`, with a child for each reason created up front (a dashboard sees
zeros, not a missing series). Per-request latencies use the engine's own timestamps (arrival,
first scheduled, first token, finish). Besides vLLM's families: the KDA state pool
(`state_slots_used` / `_total`) and the attention cache's blocks. With speculative decoding,
vLLM's `spec_decode_*` counters (drafts, drafted and accepted tokens, accepted per draft
position, engine/speculative/stats.py). Each server owns its own
registry (several servers can live in one process: the tests), with the process collector.

Several API server processes on one engine (`--api-server-count`) use prometheus_client's
multiprocess mode, as vLLM does: each process writes its values to files under
PROMETHEUS_MULTIPROC_DIR (set before prometheus_client is imported: server/api_servers.py) and
`/metrics` in any of them shows the sum of the counters and histograms over all, the engine's
gauges as last set (every process gets the same stats). The counters that follow the engine's own
totals (preemptions, prefix-cache queries and hits, speculative decoding) and the step-size
histogram are kept by the first process only, so they are not counted once per process.
"""

from __future__ import annotations

import bisect
import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

PREFIX = "kdaserve:"
FINISHED_REASONS = ("stop", "length", "abort")
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_INTERVAL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                           0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000,
                        500000, 1000000)


def observe_many(histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for each value, with one update per bucket the values fall in and
    one of the sum: a step's inter-token latencies (one per stream) fall in a bucket or two, and
    each update is a lock (a file write in multiprocess mode, 2 us), paid per token of every
    stream. Through prometheus_client's Histogram fields where it has them (0.20-0.26 do), else
    one observe per value."""
    bounds, buckets, total = (getattr(histogram, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for value in values:
            histogram.observe(value)
        return
    counts: dict[int, int] = {}
    for value in values:
        i = bisect.bisect_left(bounds, value)   # the first bound >= value, as observe's scan finds it
        counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, n in counts.items():
        buckets[i].inc(n)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, *, cache_info: dict | None = None, num_speculative_tokens: int = 0,
                 multiprocess: bool = False, engine_counters: bool = True):
        if multiprocess and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            raise ValueError("multiprocess metrics need PROMETHEUS_MULTIPROC_DIR set before prometheus_client is imported")
        self.multiprocess, self.engine_counters = multiprocess, engine_counters
        self.registry = r = CollectorRegistry()
        if not multiprocess:   # per-process figures: no meaning summed over processes
            ProcessCollector(registry=r)
        self._labels = {"model_name": model_name, "engine": "0"}
        names = tuple(self._labels)
        # The engine's gauges: every process sets the same values, so the latest one stands.
        gauge_mode = {"multiprocess_mode": "mostrecent"} if multiprocess else {}

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, names, registry=r, **gauge_mode).labels(**self._labels)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, names, registry=r).labels(**self._labels)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=r).labels(**self._labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Attention cache usage: 1 means 100 percent.")
        self.state_slots_used = gauge("state_slots_used", "KDA recurrent-state cache slots in use.")
        self.state_slots_total = gauge("state_slots_total", "KDA recurrent-state cache slots in all.")
        self.kv_blocks_used = gauge("kv_blocks_used", "Attention cache blocks in use.")
        self.kv_blocks_total = gauge("kv_blocks_total", "Attention cache blocks in all.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens computed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (their caches freed, recomputed later).")
        # vLLM's prefix-cache counters (tokens), created whether or not caching is on, and the
        # prefix cache's contents (kdaserve's: the KDA state checkpoints are ours).
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prefix_cache_blocks = gauge("prefix_cache_blocks", "Attention cache blocks registered in the prefix cache.")
        self.prefix_cache_kda_states = gauge("prefix_cache_kda_states", "KDA state checkpoints held by the prefix cache.")
        self._last_prefix = {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self._finished = Counter(PREFIX + "request_success", "Requests finished, by finished_reason.",
                                 names + ("finished_reason",), registry=r)
        for reason in FINISHED_REASONS:
            self._finished.labels(**self._labels, finished_reason=reason)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          _TOKEN_COUNT_BUCKETS)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to the first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between two tokens of a request.",
                                             _TOKEN_INTERVAL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Per request: (finish - first token) / (output tokens - 1).",
            _TOKEN_INTERVAL_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to the last token.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to the first token.",
                                      _LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to the last.", _LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to the last token.",
                                        _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                               _TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per finished request.", _TOKEN_COUNT_BUCKETS)
        info = {k: str(v) for k, v in (cache_info or {}).items()}
        Gauge(PREFIX + "cache_config_info", "The cache configuration (labels), value 1.", tuple(info),
              registry=r, **gauge_mode).labels(**info).set(1)
        self._last_preemptions = 0
        self._spec = None
        if num_speculative_tokens:
            per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens, by draft position.",
                              names + ("position",), registry=r)
            self._spec = {
                "spec_decode_num_drafts": counter("spec_decode_num_drafts", "Verifies of requests that proposed drafts."),
                "spec_decode_num_draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens proposed."),
                "spec_decode_num_accepted_tokens": counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
                "per_pos": [per_pos.labels(**self._labels, position=str(i)) for i in range(num_speculative_tokens)],
            }
            self._last_spec: dict = {}

    def finished(self, reason: str):
        return self._finished.labels(**self._labels, finished_reason=reason)

    def observe_finished(self, metrics: dict, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A finished request's latencies from the engine's timestamps (time.monotonic)."""
        arrival, scheduled = metrics.get("arrival_time"), metrics.get("first_scheduled_time")
        first, finish = metrics.get("first_token_time"), metrics.get("finish_time")
        if arrival is not None and finish is not None:
            self.e2e_latency.observe(finish - arrival)
        if arrival is not None and scheduled is not None:
            self.queue_time.observe(scheduled - arrival)
        if scheduled is not None and first is not None:
            self.prefill_time.observe(first - scheduled)
        if first is not None and finish is not None:
            self.decode_time.observe(finish - first)
            if num_output_tokens > 1:
                self.request_time_per_output_token.observe((finish - first) / (num_output_tokens - 1))
        if scheduled is not None and finish is not None:
            self.inference_time.observe(finish - scheduled)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)

    def update_from_stats(self, stats: dict) -> None:
        running, waiting = stats.get("num_running"), stats.get("num_waiting")
        if running is not None:
            self.num_requests_running.set(running)
        if waiting is not None:
            self.num_requests_waiting.set(waiting)
        for name in ("state_slots_used", "state_slots_total", "kv_blocks_used", "kv_blocks_total"):
            if stats.get(name) is not None:
                getattr(self, name).set(stats[name])
        if stats.get("kv_blocks_total"):
            self.kv_cache_usage_perc.set(stats.get("kv_blocks_used", 0) / stats["kv_blocks_total"])
        if stats.get("prefix_cache_blocks") is not None:
            self.prefix_cache_blocks.set(stats["prefix_cache_blocks"])
            self.prefix_cache_kda_states.set(stats["prefix_cache_states"])
        if not self.engine_counters:
            return
        if self._spec is not None:
            self._update_spec(stats)
        for name, last in self._last_prefix.items():
            value = stats.get(name)
            if value is not None and value > last:
                getattr(self, name).inc(value - last)
                self._last_prefix[name] = value
        preemptions = stats.get("preemptions")
        if preemptions is not None and preemptions > self._last_preemptions:
            self.num_preemptions.inc(preemptions - self._last_preemptions)
            self._last_preemptions = preemptions

    def _update_spec(self, stats: dict) -> None:
        """The engine keeps running totals; the counters advance by what is new since last time."""
        for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
            value, last = stats.get(name), self._last_spec.get(name, 0)
            if value is not None and value > last:
                self._spec[name].inc(value - last)
                self._last_spec[name] = value
        per_pos, last = stats.get("spec_decode_num_accepted_tokens_per_pos") or [], self._last_spec.get("per_pos") or []
        for i, (child, value) in enumerate(zip(self._spec["per_pos"], per_pos)):
            before = last[i] if i < len(last) else 0
            if value > before:
                child.inc(value - before)
        self._last_spec["per_pos"] = list(per_pos)

    def render(self) -> bytes:
        if self.multiprocess:   # every API server process's values
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
