"""Exponential, reciprocal and sigmoid as single MUFU instructions on NVIDIA GPUs.

Triton lowers `tl.exp` to `ex2.approx.f32` without flush-to-zero, which ptxas wraps in a
subnormal range check (6 SASS instructions instead of 2), and `1 / x` to `div.full.f32` (5
instead of 1). K1 evaluates ~10 of these per element of its q/k/v tiles, so they are a large
share of its instruction count. The `.ftz` forms differ only where a result would be subnormal
(|result| < 1.2e-38, flushed to 0), which nothing here can distinguish from 0; their relative
error is ~2^-22. FAST=False (the interpreter, ROCm) uses plain Triton math.

`sigmoid_tanh` saves one more MUFU at some accuracy: see its docstring for where that is safe.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def fast_exp(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * LOG2E],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x)


@triton.jit
def fast_rcp(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def fast_sigmoid(x, FAST: tl.constexpr):
    return fast_rcp(1.0 + fast_exp(-x, FAST), FAST)


@triton.jit
def sigmoid_tanh(x, FAST: tl.constexpr):
    """sigmoid(x) = 1/2 + tanh(x/2)/2 with one MUFU (`tanh.approx.f32`, relative error 2^-11)
    instead of fast_sigmoid's two (ex2 + rcp). Its error is absolute, up to ~2.5e-4 (half of
    tanh.approx's documented 2^-10.99), so it is for factors of quantities whose error counts
    relative to their row's norm, which are later rounded to fp16/bf16 anyway:
    the conv's SiLU (q and k are l2-normalized after it, v is rounded to fp16 inside U~) and the
    output gate of the gated RMSNorm (bf16 output, 2^-9). Never for the decay gate: a slow-decay
    channel's sigmoid is tiny and needs relative accuracy, which the documented bound does not
    give near 0."""
    if FAST:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x * 0.5],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return 0.5 + 0.5 * t
    else:
        return fast_sigmoid(x, FAST)
