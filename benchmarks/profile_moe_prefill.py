"""The fused MoE kernels under Nsight Compute: what limits them (issue 21 goal 4 at prefill; with
`--format mxfp4 --tokens 64`, issue 63's 4-bit decode).

    PYTHONPATH=$PWD ncu --kernel-name regex:_moe_ --launch-skip 3 --launch-count 3 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 benchmarks/profile_moe_prefill.py [--tokens 8192] [--format bf16 | mxfp4 | nvfp4]

Kimi-Linear's routed experts (256 x hidden 2304 x width 1024, top 8) at random, routed by the
router kernel, moe_experts_fused called twice (the first compiles; ncu skips its three MoE
launches: gate|up, down, sum) so the profiled launches are the second call's. Prints the bytes
the weights and activations must move and the flops, to read ncu's DRAM bytes and tensor-pipe
activity against.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_moe_mla import HIDDEN, WIDTH, expert_formats, routed_experts  # noqa: E402
from kdaserve.ops.moe import route_tokens  # noqa: E402
from kdaserve.ops.moe.fused import moe_experts_fused  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--format", choices=("bf16", "mxfp4", "nvfp4"), default="bf16", help="the experts' weights")
    args = ap.parse_args()
    g, w13, w2, gate, router = routed_experts()
    (w13, w2), _, per_param = expert_formats(w13, w2)[args.format]
    x = torch.randn(args.tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    weights, ids = route_tokens(x, gate, None, router)
    for _ in range(2):
        moe_experts_fused(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    touched = ids.unique().numel()
    S = ids.numel()
    print(f"{args.tokens} tokens, {S} slots, {touched} experts: {args.format} weights gate|up "
          f"{touched * 2 * WIDTH * HIDDEN * per_param / 1e9:.4f} GB, down {touched * HIDDEN * WIDTH * per_param / 1e9:.4f} GB; "
          f"activations x {args.tokens * HIDDEN * 2 / 1e9:.3f} GB, "
          f"h {S * WIDTH * 2 / 1e9:.3f} GB, y {S * HIDDEN * 2 / 1e9:.3f} GB; "
          f"GFLOP gate|up {2 * S * HIDDEN * 2 * WIDTH / 1e9:.0f}, down {2 * S * WIDTH * HIDDEN / 1e9:.0f} (routed rows, no "
          "padding)")


if __name__ == "__main__":
    main()
