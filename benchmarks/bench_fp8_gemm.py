"""Block-scaled FP8 GEMMs (ops/fp8, the FP8 path of ops/moe/fused.py) against bf16 at GLM-5.3-Flash's
sizes, on one GPU: ms per call (do_bench median, activation quantization included in the FP8
columns), the weight bytes each reads, and the rate against the copy ceiling (decode) or bf16/FP8
tensor throughput (prefill).

    python benchmarks/bench_fp8_gemm.py            # every shape
    python benchmarks/bench_fp8_gemm.py --tokens 1 64
    python benchmarks/bench_fp8_gemm.py --sweep    # the linear GEMM's tile configs, best per shape

Linear: torch's bf16 matmul (cuBLAS) vs block_fp8_linear. Experts: the fused MoE kernels in bf16 vs
FP8, 64 of GLM's 288 experts (top 8; the bytes scale with the experts the batch touches)."""

from __future__ import annotations

import argparse

import torch
import triton

from kdaserve.ops.fp8.block_gemm import block_fp8_linear
from kdaserve.ops.fp8.reference import quantize_blocks
from kdaserve.ops.moe import RouterConfig, route_tokens
from kdaserve.ops.moe.fused import moe_experts_fused

HIDDEN, DENSE, EXPERT, HEADS_V = 4096, 12288, 2048, 64 * 256
LINEARS = {"mlp gate|up": (2 * DENSE, HIDDEN), "mlp down": (HIDDEN, DENSE), "attn o_proj": (HIDDEN, HEADS_V),
           "attn q_b": (64 * 256, 1536)}


# (BM, BN, warps, stages) tried by --sweep: spill-free on sm_90 (tools/compile_check's resources).
SWEEP = {"decode": [(16, 32, 4, 4), (16, 32, 4, 6), (16, 64, 4, 4), (16, 64, 4, 6), (16, 128, 4, 3), (16, 128, 4, 4),
                    (32, 64, 4, 4), (32, 128, 4, 4), (64, 64, 4, 3), (64, 64, 4, 4)],
         "prefill": [(64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 128, 8, 3),
                     (64, 256, 8, 3)]}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def sweep(tokens: list[int]) -> None:
    from kdaserve.ops.fp8.block_gemm import block_fp8_gemm, gemm_config
    from kdaserve.ops.fp8.quant import quantize_per_token_group

    block = (128, 128)
    print(f"\n{torch.cuda.get_device_name()}; the GEMM alone (activations quantized beforehand), ms, do_bench median")
    print("| op | shape | default config | default ms | best config | best ms | bf16 ms | best vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (N, K) in LINEARS.items():
        w = torch.randn(N, K, device="cuda") * K**-0.5
        wb, (wq, ws) = w.bfloat16(), quantize_blocks(w, block)
        for T in tokens:
            x = torch.randn(T, K, device="cuda").bfloat16()
            xq, xs = quantize_per_token_group(x, 128)
            times = {}
            for config in SWEEP["decode" if T <= 64 else "prefill"]:
                times[config] = bench(lambda: block_fp8_gemm(xq, xs, wq, ws, block, torch.bfloat16, config=config))
            best = min(times, key=times.get)
            default = gemm_config(T)
            td = times.get(default) or bench(lambda: block_fp8_gemm(xq, xs, wq, ws, block, torch.bfloat16))
            tb = bench(lambda: x @ wb.T)
            print(f"| {name} | {T}x{N}x{K} | {default} | {td:.4f} | {best} | {times[best]:.4f} | {tb:.4f} | "
                  f"{tb / times[best]:.2f}x |", flush=True)
            print("  all: " + ", ".join(f"{c}: {t:.4f}" for c, t in sorted(times.items(), key=lambda kv: kv[1])), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 4096])
    ap.add_argument("--sweep", action="store_true", help="time the linear GEMM's tile configs instead")
    args = ap.parse_args()
    if args.sweep:
        sweep(args.tokens)
        return
    torch.manual_seed(0)
    block = (128, 128)
    rows = []
    for name, (N, K) in LINEARS.items():
        w = torch.randn(N, K, device="cuda") * K**-0.5
        wb, (wq, ws) = w.bfloat16(), quantize_blocks(w, block)
        for T in args.tokens:
            x = torch.randn(T, K, device="cuda").bfloat16()
            tb = bench(lambda: x @ wb.T)
            tf = bench(lambda: block_fp8_linear(x, wq, ws, block))
            rows.append((name, f"{T}x{N}x{K}", tb, tf, N * K * 2, N * K))
    E, k = 64, 8
    w13 = torch.randn(E, 2 * EXPERT, HIDDEN, device="cuda") * HIDDEN**-0.5
    w2 = torch.randn(E, HIDDEN, EXPERT, device="cuda") * EXPERT**-0.5
    (q13, s13), (q2, s2) = quantize_blocks(w13, block), quantize_blocks(w2, block)
    b13, b2 = w13.bfloat16(), w2.bfloat16()
    gate = torch.randn(E, HIDDEN, device="cuda") * HIDDEN**-0.5
    for T in args.tokens:
        x = torch.randn(T, HIDDEN, device="cuda").bfloat16()
        weights, ids = route_tokens(x, gate, None, RouterConfig(E, k, routed_scaling_factor=2.5))
        touched = ids.unique().numel()
        tb = bench(lambda: moe_experts_fused(x, b13, b2, weights, ids, 10.0))
        tf = bench(lambda: moe_experts_fused(x, q13, q2, weights, ids, 10.0, w13_scale=s13, w2_scale=s2, block=block))
        per_expert = 3 * EXPERT * HIDDEN
        rows.append((f"experts ({touched} of {E} touched)", f"T={T}", tb, tf, touched * per_expert * 2, touched * per_expert))
    print(f"\n{torch.cuda.get_device_name()}; ms per call (do_bench median); GB/s = weight bytes read / time")
    print("| op | shape | bf16 ms | fp8 ms | fp8 speedup | bf16 GB/s | fp8 GB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, shape, tb, tf, bb, bf in rows:
        print(f"| {name} | {shape} | {tb:.4f} | {tf:.4f} | {tb / tf:.2f}x | {bb / tb / 1e6:.0f} | {bf / tf / 1e6:.0f} |")


if __name__ == "__main__":
    main()
