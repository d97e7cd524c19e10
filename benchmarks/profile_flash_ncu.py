"""One flash prefill step, run twice, for Nsight Compute: what limits K1 (prepare) and K2.

    PYTHONPATH=$PWD ncu --kernel-name regex:flash_prepare --launch-skip 2 --launch-count 1 --set full \
        python3 benchmarks/profile_flash_ncu.py --heads 64 --shape 16x1K [--gate unbounded] [--config ...]

The first call compiles; with the bounded gate a step launches K1 twice (the chunks inside the
new tokens, then each sequence's first chunk), so `--launch-skip 2` profiles the second call's
main K1 launch. Prints the bytes K1 must move per token-head (its memory floor), to read ncu's
DRAM bytes and duration against. Inputs as bench_prefill.py's (bf16 q|k|v views, fp32 state pool).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_prefill import config_planner, gpu_case, parse_shape, with_step_plan  # noqa: E402
from kdaserve.backends import planners  # noqa: E402
from kdaserve.ops.kda.flash import kda_prefill_flash  # noqa: E402


def k1_bytes_per_token_head(D: int, C: int) -> int:
    """K1's compulsory traffic per token-head: q|k|v (bf16) and the forget logits read, beta's
    logit; W, U~, Qg, Kd (fp16 [D] each) and an Aqk row (fp16 [C]) written, the chunk decay (fp32
    [D] per chunk) shared by its C tokens."""
    return 3 * D * 2 + D * 2 + 2 + 4 * D * 2 + C * 2 + D * 4 // C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--shape", default="16x1K")
    ap.add_argument("--gate", choices=("bounded", "unbounded"), default="bounded")
    ap.add_argument("--config", default=None, help="field=value[,...]: the FlashConfig changed so")
    args = ap.parse_args()
    case = gpu_case(parse_shape(args.shape), args.heads, gate=args.gate)
    planner = config_planner(args.config) if args.config else planners.flash_plan
    fn = with_step_plan(kda_prefill_flash, planner)
    out, a = case.new_out(), case.prefill_args()
    for _ in range(2):
        fn(out=out, **a)
    torch.cuda.synchronize()
    T = sum(case.seq_lens)
    per = k1_bytes_per_token_head(case.D, 32)
    print(f"{args.heads} heads x {args.shape} ({T} tokens), {args.gate} gate: K1 must move {per} B per token-head, "
          f"{per * T * args.heads / 1e9:.3f} GB in all")


if __name__ == "__main__":
    main()
