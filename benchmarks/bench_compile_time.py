"""Start-up compile per gate: the first calls of a fresh process with an empty Triton cache.

Flash's prefill alone (default): the shapes that select every launch variant a server compiles at
warm-up (a short step, many sequences, and one long sequence, which flash segments: for the
unbounded gate that is also where it takes 32-token chunks), each call as the engine's warm-up
makes it (ops/compile_ahead.py: with more than one compile thread, a call's kernels compile in
parallel before it launches them). `--engine MODEL` (a built-in hybrid, e.g. `bench`): the whole
engine instead, its construction (weights, CUDA graphs: the decode kernels compile there) and its
warm-up, the model's KDA layers given each gate. One subprocess per (gate, threads), so none
reuses another's compiled kernels; each prints its seconds.

    PYTHONPATH=$PWD python benchmarks/bench_compile_time.py [--heads 32] [--gates bounded unbounded]
        [--threads 1 auto] [--engine bench]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

SHAPES = ("4x100", "16x1K", "1x8K")


def one_gate(gate: str, H: int, threads: str) -> None:
    import torch

    from benchmarks.bench_prefill import gpu_case, parse_shape, with_step_plan
    from kdaserve.backends import planners
    from kdaserve.ops.compile_ahead import warm_up_compiles
    from kdaserve.ops.kda.flash import kda_prefill_flash

    col = with_step_plan(kda_prefill_flash, planners.flash_plan)
    total, parts = 0.0, []
    for shape in SHAPES:
        case = gpu_case(parse_shape(shape), H, gate=gate)
        out, args = case.new_out(), case.prefill_args()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with warm_up_compiles():
            col(out=out, **args)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        total += dt
        parts.append(f"{dt:.1f}")
    print(f"| {gate} | {H} | {threads} | {' | '.join(parts)} | {total:.1f} |", flush=True)


def one_engine(gate: str, model: str, threads: str) -> None:
    from kdaserve.engine.llm_engine import LLMEngine
    from kdaserve.models.builtin import BUILTIN_CONFIGS

    if model not in BUILTIN_CONFIGS:
        raise SystemExit(f"--engine takes a built-in hybrid model ({sorted(BUILTIN_CONFIGS)}), got {model!r}")
    if gate == "unbounded":   # Kimi-Linear's gate on the same layers (A_log and dt_bias instead of a bound)
        BUILTIN_CONFIGS[model].linear_lower_bound = None
    t0 = time.perf_counter()
    engine = LLMEngine(model=model, warmup=False, seed=0)
    t1 = time.perf_counter()
    steps = engine.warm_up()
    t2 = time.perf_counter()
    print(f"| {model} | {gate} | {threads} | {t1 - t0:.1f} | {t2 - t1:.1f} ({steps} steps) | {t2 - t0:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--gates", nargs="+", default=["bounded", "unbounded"], choices=["bounded", "unbounded"])
    ap.add_argument("--threads", nargs="+", default=["1", "auto"],
                    help="compile threads ($KDASERVE_COMPILE_THREADS; 1: each kernel at its first launch, auto: the "
                         "usable cores)")
    ap.add_argument("--engine", default=None, metavar="MODEL", help="time a whole engine's start-up instead")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # the subprocess's gate
    ap.add_argument("--one-threads", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        if args.engine:
            one_engine(args.one, args.engine, args.one_threads)
        else:
            one_gate(args.one, args.heads, args.one_threads)
        return
    if args.engine:
        print("engine start-up in a fresh process, empty Triton cache, s\n| model | gate | compile threads | construction "
              "(CUDA graphs) | warm-up | total |\n|---|---|---|---|---|---|", flush=True)
    else:
        print(f"first calls in a fresh process, empty Triton cache, s\n| gate | H | compile threads | "
              f"{' | '.join(SHAPES)} | total |\n|---|---|---|{'---|' * (len(SHAPES) + 1)}", flush=True)
    for gate in args.gates:
        for threads in args.threads:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache)
                env.pop("KDASERVE_COMPILE_THREADS", None)
                if threads != "auto":
                    env["KDASERVE_COMPILE_THREADS"] = threads
                subprocess.run([sys.executable, __file__, "--one", gate, "--one-threads", threads, "--heads", str(args.heads),
                                *(["--engine", args.engine] if args.engine else [])], env=env, check=False)


if __name__ == "__main__":
    main()
