"""Start-up compile of flash's prefill per gate: the first calls of a fresh process with an empty
Triton cache, over the shapes that select every launch variant a server compiles at warm-up
(a short step, many sequences, and one long sequence, which flash segments: for the unbounded gate
that is also where it takes 32-token chunks). One subprocess per gate, so neither reuses the
other's compiled kernels; each prints its seconds per shape and in total.

    PYTHONPATH=$PWD python benchmarks/bench_compile_time.py [--heads 32] [--gates bounded unbounded]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

SHAPES = ("4x100", "16x1K", "1x8K")


def one_gate(gate: str, H: int) -> None:
    import torch

    from benchmarks.bench_prefill import gpu_case, parse_shape, with_step_plan
    from kdaserve.backends import planners
    from kdaserve.ops.flash import kda_prefill_flash

    col = with_step_plan(kda_prefill_flash, planners.flash_plan)
    total, parts = 0.0, []
    for shape in SHAPES:
        case = gpu_case(parse_shape(shape), H, gate=gate)
        out, args = case.new_out(), case.prefill_args()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        col(out=out, **args)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        total += dt
        parts.append(f"{dt:.1f}")
    print(f"| {gate} | {H} | {' | '.join(parts)} | {total:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--gates", nargs="+", default=["bounded", "unbounded"], choices=["bounded", "unbounded"])
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # the subprocess's gate
    args = ap.parse_args()
    if args.one:
        one_gate(args.one, args.heads)
        return
    print(f"first calls in a fresh process, empty Triton cache, s\n| gate | H | {' | '.join(SHAPES)} | total |\n"
          f"|---|---|{'---|' * (len(SHAPES) + 1)}", flush=True)
    for gate in args.gates:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            subprocess.run([sys.executable, __file__, "--one", gate, "--heads", str(args.heads)], env=env, check=False)


if __name__ == "__main__":
    main()
