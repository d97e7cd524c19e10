"""Throughput and TTFT through `kdaserve serve` at concurrencies below and above --max-num-seqs:
past the engine's batch, requests must queue while throughput stays at the full batch's level
(issue 65: 128 streams against 64 slots once fell to a third of 64 streams' throughput).

How: `kdaserve serve MODEL` in its own process with the given flags, then for each concurrency a
client keeping that many streaming completions open (httpx, one asyncio process) until
--requests have finished; tokens counted from the SSE chunks. Prints one table row per
concurrency: output tokens/s over the whole run, TTFT p50/p99 (queueing shows here), and the
server's preemptions from /metrics.

    PYTHONPATH=$PWD python benchmarks/bench_concurrency.py [--model tiny] [--concurrency 64 128]
        [--requests 256] [--max-tokens 64] [--serve-flags "--device cpu --max-num-seqs 64"]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import time

import httpx

from kdaserve.server.launch import free_port


async def _run(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    ttfts, tokens = [], 0
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        body = {"model": model, "prompt": f"Request {i}: " + "hello " * 16, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True, "temperature": 0}
        async with gate:
            t0, first = time.monotonic(), None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        tokens += 1
                        first = first if first is not None else time.monotonic() - t0
            ttfts.append(first)

    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(one(client, i) for i in range(requests)))
        seconds = time.monotonic() - t0
    ttfts.sort()
    return {"tokens": tokens, "seconds": seconds, "ttft_p50": ttfts[len(ttfts) // 2],
            "ttft_p99": ttfts[max(int(len(ttfts) * 0.99) - 1, 0)]}


def _preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kdaserve:num_preemptions"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="the model served (default: tiny)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 128], help="streams open at once (default: 64 128)")
    p.add_argument("--requests", type=int, default=256, help="requests per concurrency (default: 256)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--serve-flags", default="--max-num-seqs 64", help="more `kdaserve serve` flags (default: "
                   "--max-num-seqs 64)")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kdaserve", "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *shlex.split(args.serve_flags)]
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                print(f"the server exited ({server.returncode})", file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                print("the server did not come up", file=sys.stderr)
                return 1
            time.sleep(0.5)
        asyncio.run(_run(url, args.model, 8, 16, 8))   # warm-up, not reported
        print(f"| {args.model} ({args.serve_flags}) | streams | output tok/s | TTFT p50 s | TTFT p99 s | preemptions |")
        print("|---|---|---|---|---|---|")
        for c in args.concurrency:
            before = _preemptions(url)
            r = asyncio.run(_run(url, args.model, c, args.requests, args.max_tokens))
            print(f"| {args.requests} x {args.max_tokens} tokens | {c} | {r['tokens'] / r['seconds']:.0f} | "
                  f"{r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {_preemptions(url) - before:.0f} |", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
