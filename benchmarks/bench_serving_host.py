"""The serving path's host cost: inter-token latency through `kdaserve serve`'s app against the
engine's own step, with the model replaced by a fixed "device time" (runs on a CPU).

Why: with 64 concurrent streams the server's median ITL was ~3x the engine's step on an H200
(issue 21): the event loop (SSE chunks, JSON, HTTP writes) and the engine thread share one
interpreter, so every stream's per-token Python delays the next step.

How: the real engine (scheduler, host step building, token appending, detokenizing, outputs) and
the real app (uvicorn, FastAPI, the engine thread), the `nano` model's tokenizer; only
`ModelRunner.execute` is replaced: it builds the host step as the real one does, sleeps
`--device-ms` (the GIL released, like a GPU step) and returns the next token of a fixed text for
every sampling sequence. A client in another process opens `--streams` streaming completions at
once and stamps every SSE chunk. Reported: the engine's step period in steady decode (median
interval between the execute calls of steps without prefills), the clients' median / p90 ITL
(interval between a stream's chunks), and ITL / step. The goal of issue 21 is ITL <= 1.15x the
step (on the GPU machine's host; this prints what this host does).

    PYTHONPATH=$PWD python benchmarks/bench_serving_host.py [--streams 64] [--device-ms 2.5]
        [--max-tokens 128] [--rounds 3] [--profile FILE] [--model bench]

`--profile FILE`: a cProfile (pstats file) of the event loop's thread over the last round.
`--model NAME`: the real model on this machine's device instead (a GPU: CUDA graphs, the engine's
default backends), the steps stamped the same way; `--device-ms` is then unused.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = b"def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


def client(url: str, model: str, streams: int, max_tokens: int, out: mp.Queue) -> None:
    import httpx

    async def one(http: httpx.AsyncClient, i: int) -> list[float]:
        body = {"model": model, "prompt": f"# stream {i}\n", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        stamps = []
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    stamps.append(time.monotonic())
        return stamps

    async def main() -> list[list[float]]:
        limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(streams)))

    out.put(asyncio.run(main()))


def fake_device(engine, device_s: float, calls: list[float]) -> None:
    from kdaserve.engine.model_runner import StepResult
    from kdaserve.engine.sampler import SampleResult
    from kdaserve.engine.step_inputs import build_host_step

    runner = engine.runner

    def execute(batch):
        if not batch.prefills:
            calls.append(time.monotonic())
        step = build_host_step(batch, runner.block_size, trash_row=runner.caches.trash_row)
        time.sleep(device_s)
        seqs = step.logits.sample_seqs
        tokens = [TEXT[s.num_output_tokens % len(TEXT)] for s in seqs]
        return StepResult(SampleResult(tokens, [None] * len(tokens)), seqs, [])

    runner.execute = execute


def stamp_steps(engine, calls: list[float]) -> None:
    execute = engine.runner.execute

    def stamped(batch):
        if not batch.prefills:
            calls.append(time.monotonic())
        return execute(batch)

    engine.runner.execute = stamped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--device-ms", type=float, default=2.5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None,
                    help="serve this model for real on the device (e.g. bench on a GPU) instead of the fixed device time")
    ap.add_argument("--profile", default=None, help="write a pstats file of the event loop's thread (last round)")
    args = ap.parse_args()

    from kdaserve.engine.llm_engine import LLMEngine
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    calls: list[float] = []
    if args.model is None:
        engine = LLMEngine("nano", kda_prefill_backend="reference", kda_decode_backend="reference",
                           max_num_seqs=args.streams, max_model_len=args.max_tokens + 64, device="cpu",
                           enforce_eager=True, seed=0)
        fake_device(engine, args.device_ms / 1e3, calls)
    else:   # the real model on this machine's device, CUDA graphs as served
        engine = LLMEngine(args.model, max_num_seqs=args.streams, max_model_len=args.max_tokens + 64, seed=0)
        engine.warm_up()
        stamp_steps(engine, calls)
    alone = engine_alone(engine, args.streams, args.max_tokens, calls)
    ctx = mp.get_context("spawn")
    rows = []
    loop_profile = None
    with BackgroundServer(build_app(engine)) as srv:
        for r in range(args.rounds):
            if args.profile and r == args.rounds - 1:   # the event loop's thread, last round only
                loop_profile = cProfile.Profile()
                srv.server.servers[0].get_loop().call_soon_threadsafe(loop_profile.enable)
            calls.clear()
            q = ctx.Queue()
            p = ctx.Process(target=client, args=(srv.url, engine.model_name, args.streams, args.max_tokens, q))
            p.start()
            stamps = q.get()
            p.join()
            # Steady decode: the steps while every stream is past its first token and none has ended.
            first = max(s[1] for s in stamps if len(s) > 1)
            last = min(s[-2] for s in stamps if len(s) > 1)
            steps = [b - a for a, b in zip(calls, calls[1:]) if first <= a and b <= last]
            itl = [b - a for s in stamps for a, b in zip(s, s[1:]) if first <= a and b <= last]
            step, med, p90 = (statistics.median(steps) * 1e3, statistics.median(itl) * 1e3,
                              statistics.quantiles(itl, n=10)[-1] * 1e3)
            rows.append((r, len(steps), step, med, p90))
            print(json.dumps({"round": r, "steps": len(steps), "step_ms": step, "itl_median_ms": med, "itl_p90_ms": p90}),
                  flush=True)
            if loop_profile is not None:
                srv.server.servers[0].get_loop().call_soon_threadsafe(loop_profile.disable)
                time.sleep(0.2)
                loop_profile.dump_stats(args.profile)
    what = f"model {args.model}" if args.model else f"device time {args.device_ms} ms per step"
    print(f"\n{args.streams} streams, {args.max_tokens} tokens each, {what} (this host); "
          f"the engine alone (no server, same batch): {alone:.2f} ms per step")
    print("| round | steady steps | engine step in the server ms | ITL median ms | ITL p90 ms | ITL / engine alone |")
    print("|---|---|---|---|---|---|")
    for r, n, step, med, p90 in rows:
        print(f"| {r} | {n} | {step:.2f} | {med:.2f} | {p90:.2f} | {med / alone:.2f}x |")


def engine_alone(engine, streams: int, max_tokens: int, calls: list[float]) -> float:
    """Median step period of the same engine at the same batch with no server: the issue's bar."""
    from kdaserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(streams):
        engine.add_request(f"alone-{i}", engine.tokenizer.encode(f"# stream {i}\n"), params)
    calls.clear()
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(b - a for a, b in zip(calls, calls[1:])) * 1e3


if __name__ == "__main__":
    main()
