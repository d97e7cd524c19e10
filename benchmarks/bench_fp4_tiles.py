"""Ways to run a 4-bit weight's K step inside a Triton GEMM (W4A16), timed side by side with the
bf16 GEMM of the same structure, on one GPU: y [M, N] = x [M, K] W[N, K]^T, W packed as
ops/fp4/weights.py keeps it (byte k of a row holds elements 2k, 2k + 1; one scale per group).

    variant   weight operand                        activations            scale applied
    split     W^T [BK/2, BN] x2 (low / high nibbles) even / odd columns,   per element, loaded
              (the kernels' earlier form)           two strided loads      per element
    swap      W [BN, BK] nibbles interleaved back,  x [BM, BK] contiguous, per element, loaded
              the dot's A operand (registers)       transposed (B)         per element
    swap_bc   as swap                               as swap                loaded per group,
                                                                           broadcast in registers
    swap_split W [BN, BK/2] x2, A operand           x [BM, BK] contiguous, per group, broadcast
                                                    split even / odd
    trans_bc  W [BN, BK] interleaved, transposed    x [BM, BK] contiguous  per group, broadcast
              into the B operand
    group_dot W [BN, GROUP] per scale group, fp16     x [BM, GROUP] per      per group, on the dot's
              bits as decoded (no fp32 pass), the A   group, cast to fp16    fp32 result [BN, BM]
              operand; one dot per group                                   (decode-sized M only)
    trans_b16 as trans_bc, decoded straight into bf16  as trans_bc           per group, broadcast,
              (ops/fp4/tiles.e2m1_bf16_pair: the                           two bf16 products a
              kernels' form for bf16 activations)                          pair (2^126, scale)
    swap_b16  as trans_b16, the dot's A operand       as swap                as trans_b16

Every variant is checked against the dequantized weight's GEMM before it is timed; the floor is
the call's bytes over the measured copy bandwidth. Decode-sized M reads the weight once per 16
rows; prefill-sized M is bound by the tensor cores.

    PYTHONPATH=$PWD python3 benchmarks/bench_fp4_tiles.py [--m 16 64 4096] [--n 8192] [--k 4096]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kdaserve.ops import interpreter_compat  # noqa: E402
from kdaserve.ops.fp4.tiles import e2m1_pair, fp4_weight_tile, group_scale  # noqa: E402

VARIANTS = ("split", "swap", "swap_bc", "swap_split", "trans_bc", "group_dot", "trans_b16", "swap_b16", "bf16")


@triton.jit
def _e2m1_fp16_pair(packed):
    """e2m1_pair's fp16 bit patterns without its fp32 pass: each value times 2^-14, as fp16."""
    p = packed.to(tl.uint16)
    lo = ((p & 7) << 9) | ((p & 8) << 12)
    hi = ((p & 0x70) << 5) | ((p & 0x80) << 8)
    return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)


@triton.jit
def _scales_per_element(s_rows, kq, GROUP: tl.constexpr):
    """[BN, BK/2] scale factors from per-element loads (one group repeated GROUP/2 times)."""
    return group_scale(tl.load(s_rows + (2 * kq // GROUP)[None, :]), GROUP)


@triton.jit
def _scales_broadcast(s_rows, k0, BK: tl.constexpr, WIDTH: tl.constexpr, GROUP: tl.constexpr):
    """[BN, WIDTH] scale factors from one load per group: each repeated WIDTH / (BK / GROUP) times."""
    g = group_scale(tl.load(s_rows + (k0 // GROUP + tl.arange(0, BK // GROUP))[None, :]), GROUP)
    BN: tl.constexpr = g.shape[0]
    return tl.reshape(tl.broadcast_to(g[:, :, None], (BN, BK // GROUP, WIDTH // (BK // GROUP))), (BN, WIDTH))


@triton.jit
def _w4_gemm(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_s, stride_y,
             GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, VARIANT: tl.constexpr,
             B16: tl.constexpr = False, TRANS: tl.constexpr = False):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)) % M
    cols = (tl.program_id(1) * BN + tl.arange(0, BN)) % N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    s_rows = s_ptr + cols.to(tl.int64)[:, None] * stride_s
    if VARIANT == "split":
        acc = tl.zeros([BM, BN], tl.float32)
    else:
        acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, K, BK):
        kq = k0 // 2 + tl.arange(0, BK // 2)
        ks = k0 + tl.arange(0, BK)
        if VARIANT == "bf16":
            w = tl.load(w_rows + ks[None, :])
            x = tl.load(x_rows + ks[None, :])
            acc = tl.dot(w, tl.trans(x), acc)
        elif VARIANT == "split":
            a_lo = tl.load(x_rows + 2 * kq[None, :])
            a_hi = tl.load(x_rows + 2 * kq[None, :] + 1)
            packed = tl.load(w_ptr + cols.to(tl.int64)[None, :] * stride_w + kq[:, None])
            sc = group_scale(tl.load(s_ptr + cols.to(tl.int64)[None, :] * stride_s + (2 * kq // GROUP)[:, None]), GROUP)
            lo, hi = e2m1_pair(packed)
            acc = tl.dot(a_lo, (lo * sc).to(a_lo.dtype), acc)
            acc = tl.dot(a_hi, (hi * sc).to(a_hi.dtype), acc)
        elif VARIANT == "group_dot":
            # Per scale group: the codes' fp16 bits straight into the dot (x cast to fp16), the
            # group's scale (and the 2^14 of the bit placement) on the fp32 result: about half the
            # ALU work per weight element of trans_bc, at one dot of K = GROUP per group.
            for gi in tl.static_range(BK // GROUP):
                kq_g = k0 // 2 + gi * (GROUP // 2) + tl.arange(0, GROUP // 2)
                x_g = tl.load(x_rows + (k0 + gi * GROUP + tl.arange(0, GROUP))[None, :]).to(tl.float16)
                lo, hi = _e2m1_fp16_pair(tl.load(w_rows + kq_g[None, :]))
                part = tl.dot(tl.interleave(lo, hi), tl.trans(x_g))
                acc += part * (group_scale(tl.load(s_rows + k0 // GROUP + gi), GROUP) * 16384.0)
        elif B16:   # the kernels' own bf16 decoding (x is bf16; every row valid, BK divides K)
            x = tl.load(x_rows + ks[None, :])
            w = fp4_weight_tile(w_rows, s_rows, True, k0, K, BK, GROUP, True, tl.bfloat16)
            if TRANS:
                acc = tl.trans(tl.dot(x, tl.trans(w), tl.trans(acc)))
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        elif VARIANT == "swap_split":
            x = tl.load(x_rows + ks[None, :])
            x_lo, x_hi = tl.split(tl.reshape(x, (BM, BK // 2, 2)))
            lo, hi = e2m1_pair(tl.load(w_rows + kq[None, :]))
            sc = _scales_broadcast(s_rows, k0, BK, BK // 2, GROUP)
            acc = tl.dot((lo * sc).to(x.dtype), tl.trans(x_lo), acc)
            acc = tl.dot((hi * sc).to(x.dtype), tl.trans(x_hi), acc)
        else:
            x = tl.load(x_rows + ks[None, :])
            lo, hi = e2m1_pair(tl.load(w_rows + kq[None, :]))
            w = tl.interleave(lo, hi)
            if VARIANT == "swap":
                w = w * tl.interleave(_scales_per_element(s_rows, kq, GROUP), _scales_per_element(s_rows, kq, GROUP))
            else:
                w = w * _scales_broadcast(s_rows, k0, BK, BK, GROUP)
            if VARIANT == "trans_bc":
                acc = tl.trans(tl.dot(x, tl.trans(w.to(x.dtype)), tl.trans(acc)))
            else:
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    if VARIANT == "split":
        out = acc
    else:
        out = tl.trans(acc)
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    tl.store(y_ptr + r.to(tl.int64)[:, None] * stride_y + c[None, :], out.to(y_ptr.dtype.element_ty),
             mask=(r < M)[:, None] & (c < N)[None, :])


def w4_gemm(x, w, variant: str, bm: int, bn: int, bk: int, warps: int, stages: int) -> torch.Tensor:
    """y = x W^T with W an ops/fp4/weights.Fp4Weights (NVFP4's divisor left out: the same work for
    every variant; the benchmark's are 1) or, for variant bf16, a dense [N, K] tensor."""
    interpreter_compat.install()
    M, K = x.shape
    dense = variant == "bf16"
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    packed, scale, group = (w, w, 32) if dense else (w.packed, w.scale, w.group)
    _w4_gemm[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, packed, scale, y, M, N, K, x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
        GROUP=group, BM=bm, BN=bn, BK=bk, VARIANT=variant, B16=variant.endswith("_b16"),
        TRANS=variant == "trans_b16", num_warps=warps, num_stages=stages)
    return y


def main() -> None:
    from benchmarks.bench_throughput import copy_bandwidth
    from kdaserve.ops.fp4.reference import quantize_mxfp4, quantize_nvfp4
    from kdaserve.ops.fp4.weights import Fp4Weights

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[16, 64, 4096])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--formats", nargs="+", default=["mxfp4", "nvfp4"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--stages", type=int, nargs="+", default=[3], help="software-pipeline stages to try")
    args = ap.parse_args()
    bw = copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(args.n, args.k, device="cuda", generator=g) * args.k**-0.5
    dense = w.to(torch.bfloat16)
    q = {}
    for fmt in args.formats:
        packed, scale, *rest = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_mxfp4(w)
        ones = torch.ones(args.n, device="cuda") if fmt == "nvfp4" else None   # every variant leaves the divisor out
        q[fmt] = Fp4Weights(packed, scale.view(torch.uint8), ones, 16 if fmt == "nvfp4" else 32)
    rows = []
    for M in args.m:
        x = torch.randn(M, args.k, device="cuda", generator=g).to(torch.bfloat16)
        stages = args.stages
        shapes = ([(16, bn, bk, 4, st) for bn, bk, st in itertools.product((64, 128), (128, 256), stages)] if M <= 16 else
                  [(64, bn, bk, wp, st) for bn, bk, wp, st in itertools.product((64, 128), (64, 128), (4, 8), stages)]
                  if M <= 128 else
                  [(128, bn, bk, 8, st) for bn, bk, st in itertools.product((64, 128), (64, 128), stages)])
        for fmt in args.formats:
            wq = q[fmt]
            ref = x.float() @ wq.dequantized(torch.float32).t()
            floor_ms = (args.n * args.k * (0.5 + 1 / wq.group) + 2 * M * (args.k + args.n)) / bw * 1e3
            for variant in args.variants:
                if variant == "bf16" and fmt != args.formats[0]:
                    continue
                best = None
                for bm, bn, bk, warps, stages in shapes:
                    try:
                        fn = lambda: w4_gemm(x, dense if variant == "bf16" else wq, variant, bm, bn, bk, warps, stages)  # noqa: E731
                        got = fn().float()
                        want = x.float() @ dense.float().t() if variant == "bf16" else ref
                        err = ((got - want).abs().max() / want.abs().max()).item()
                        ms = triton.testing.do_bench(fn, warmup=5, rep=30)
                    except Exception as exc:   # a shape a variant cannot compile (shared memory): skipped
                        print(f"# {fmt} {variant} {(bm, bn, bk, warps, stages)}: {type(exc).__name__}", flush=True)
                        continue
                    if err > 2e-2:
                        print(f"# {fmt} {variant} {(bm, bn, bk, warps, stages)}: WRONG (max rel err {err:.3g})")
                        continue
                    print(f"# M={M} {fmt} {variant} {(bm, bn, bk, warps, stages)} {ms:.4f} ms", flush=True)
                    if best is None or ms < best[0]:
                        best = (ms, (bm, bn, bk, warps, stages))
                if best:
                    name = "bf16" if variant == "bf16" else fmt
                    bf_floor = (args.n * args.k * 2 + 2 * M * (args.k + args.n)) / bw * 1e3
                    rows.append((M, name, variant, best[0], best[1], bf_floor if variant == "bf16" else floor_ms))
    print(f"\nN {args.n}, K {args.k}, {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; "
          "best launch shape per variant (BM, BN, BK, warps, stages)")
    print("| M | weights | variant | ms | x floor | TFLOP/s | shape |")
    print("|---|---|---|---|---|---|---|")
    for M, name, variant, ms, shape, floor in rows:
        print(f"| {M} | {name} | {variant} | {ms:.4f} | {ms / floor:.2f}x | {2 * M * args.n * args.k / ms / 1e9:.1f} | {shape} |")


if __name__ == "__main__":
    main()
