"""Exponential, reciprocal and sigmoid as single MUFU instructions on NVIDIA GPUs.

Triton lowers `tl.exp` to `ex2.approx.f32` without flush-to-zero, which ptxas wraps in a
subnormal range check (6 SASS instructions instead of 2), and `1 / x` to `div.full.f32` (5
instead of 1). K1 evaluates ~10 of these per element of its q/k/v tiles, so they are a large
share of its instruction count. The `.ftz` forms differ only where a result would be subnormal
(|result| < 1.2e-38, flushed to 0), which nothing here can distinguish from 0; their relative
error is ~2^-22. FAST=False (the interpreter, ROCm) uses plain Triton math.
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
