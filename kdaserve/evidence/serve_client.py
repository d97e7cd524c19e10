"""A small serving benchmark client: streaming `/v1/completions` requests at a fixed concurrency,
timed per token, summarized under the keys `vllm bench serve` writes to its results JSON
(`duration`, `completed`, `request_throughput`, `output_throughput`, `mean_ttft_ms`,
`p99_itl_ms`, ..., and the per-request `ttfts`, `itls`, `input_lens`, `output_lens`), so results
of either client read the same. Used by `kdaserve ab`; `vllm bench serve` works against the server
too, where it installs."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

PERCENTILES = (50, 90, 99)


async def _one(client, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, last, itls, tokens, error = None, None, [], 0, ""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"success": False, "error": f"{r.status_code} {(await r.aread())[:200]!r}", "prompt_len": len(prompt)}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                # Every chunk with a choice is a token step, its text possibly empty (a token that
                # completes no character yet): counted as `vllm bench serve` counts it.
                if event.get("choices"):
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itls.append(now - last)
                    last = now
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        error = f"{type(exc).__name__}: {exc}"
    latency = time.perf_counter() - t0
    if ttft is None and not error:
        error = "the stream ended without a token"
    ok = not error
    return {"success": ok, "error": error, "prompt_len": len(prompt), "output_len": tokens, "ttft": ttft,
            "itls": itls, "latency": latency}


async def _run(base_url: str, model: str, prompts: list[list[int]], output_len: int, max_concurrency: int,
               headers: dict) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=max_concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits, headers=headers) as client:
        gate = asyncio.Semaphore(max_concurrency)

        async def bounded(p):
            async with gate:
                return await _one(client, model, p, output_len)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(bounded(p) for p in prompts))
        return outs, time.perf_counter() - t0


def _stats(name: str, values_s: list[float], result: dict) -> None:
    ms = np.asarray(values_s or [0.0]) * 1000
    result[f"mean_{name}_ms"] = float(ms.mean())
    result[f"median_{name}_ms"] = float(np.median(ms))
    result[f"std_{name}_ms"] = float(ms.std())
    for p in PERCENTILES:
        result[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))


def benchmark(base_url: str, model: str, prompts: list[list[int]], output_len: int, max_concurrency: int = 8,
              api_key: str | None = None) -> dict:
    """Run every prompt once; the results in `vllm bench serve`'s keys."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    outs, duration = asyncio.run(_run(base_url, model, prompts, output_len, max_concurrency, headers))
    good = [o for o in outs if o["success"]]
    out_tokens = sum(o["output_len"] for o in good)
    in_tokens = sum(o["prompt_len"] for o in good)
    tpots = [(o["latency"] - o["ttft"]) / (o["output_len"] - 1) for o in good if o["output_len"] > 1]
    result = {
        "duration": duration, "completed": len(good), "failed": len(outs) - len(good),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(good) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration, "max_concurrency": max_concurrency,
        "input_lens": [o["prompt_len"] for o in outs], "output_lens": [o.get("output_len", 0) for o in outs],
        "ttfts": [o.get("ttft") for o in outs], "itls": [o.get("itls", []) for o in outs],
        "errors": [o["error"] for o in outs],
    }
    _stats("ttft", [o["ttft"] for o in good], result)
    _stats("tpot", tpots, result)
    _stats("itl", [x for o in good for x in o["itls"]], result)
    _stats("e2el", [o["latency"] for o in good], result)
    return result
