"""vLLM's per-request `metrics` in a response (its top-level `metrics` field; in a stream, on the
final usage chunk): timing with `--enable-per-request-metrics`, the request's speculative
acceptance whenever speculation ran. Only for single-sequence requests, as vLLM: the n choices
of one request have n different timelines."""

from __future__ import annotations


def per_request_metrics(finals: list, timing: bool) -> dict | None:
    if len(finals) != 1 or finals[0] is None:
        return None
    out = finals[0]
    m, n = out.metrics, len(out.output_token_ids)
    body: dict = {}
    if timing:
        scheduled, first, last = m.get("first_scheduled_time"), m.get("first_token_time"), m.get("finish_time")
        arrival = m.get("arrival_time")
        ms = lambda a, b: (b - a) * 1000 if a is not None and b is not None else None  # noqa: E731
        body = {
            "time_to_first_token_ms": ms(scheduled, first),
            "generation_time_ms": ms(first, last),
            "queue_time_ms": ms(arrival, scheduled),
            "mean_itl_ms": ms(first, last) / (n - 1) if n > 1 and first is not None and last is not None else None,
            "tokens_per_second": (n / (last - scheduled) if scheduled is not None and last is not None and last > scheduled
                                  else None),
        }
    if "spec_decode" in m:
        body["speculative_decoding"] = m["spec_decode"]
    return body or None
