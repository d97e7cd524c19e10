"""Triton math shared by every KDA kernel: the forget gate (both kinds), an accurate log1p and
softplus, the l2 norm of q and k, and the gated RMSNorm factor; `tl_dtype`, a torch dtype as a
kernel's dtype constexpr. One definition each, so a fix
reaches every backend (docs/kda-semantics.md section 1 is what they compute).

All functions take and return fp32 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def tl_dtype(dtype: torch.dtype | None, default: torch.dtype = torch.float32):
    """The Triton dtype of a torch dtype (None: `default`'s), for dtype constexprs."""
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
            torch.float64: tl.float64}[dtype or default]


L2_NORM_EPS = tl.constexpr(1e-6)  # inside the square root (docs/kda-semantics.md section 1.3)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's default: softplus(x) = x above it


@triton.jit
def log1p(x):
    """log(1 + x), accurate for tiny x (the interpreter and some backends have no log1p): with
    u = 1 + x rounded, log(u) * x / (u - 1) cancels u's rounding error; exact where u == 1."""
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def softplus(x):
    """torch's softplus (threshold 20) to fp32 accuracy everywhere. For x << 0 softplus(x) ~ e^x is
    tiny: a plain log(1 + exp(x)) rounds 1 + e^x first and keeps only ~1e-7 / e^x of its digits,
    an error the unbounded gate then multiplies by exp(A_log) (up to ~16) and the state compounds."""
    return tl.where(x > SOFTPLUS_THRESHOLD, x, tl.maximum(x, 0.0) + log1p(tl.exp(-tl.abs(x))))


@triton.jit
def log_decay(x, a, lower_bound, BOUNDED: tl.constexpr):
    """The per-channel log-decay gk from x = forget_logits + dt_bias and a = exp(A_log):
    bounded LB * sigmoid(a x) (LB = lower_bound in [-5, 0)), unbounded -a * softplus(x)."""
    if BOUNDED:
        gk = lower_bound * tl.sigmoid(a * x)
    else:
        gk = -a * softplus(x)
    return gk


@triton.jit
def l2_normalize(x, scale):
    """x / sqrt(sum x^2 + 1e-6) * scale over a 1-D vector (a head's K values)."""
    return x * (tl.rsqrt(tl.sum(x * x, 0) + L2_NORM_EPS) * scale)


@triton.jit
def l2_normalize_rows(x):
    """Each row of a [rows, K] tile divided by sqrt(its sum of squares + 1e-6)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + L2_NORM_EPS)[:, None]


@triton.jit
def rms_rstd(sum_of_squares, eps, D: tl.constexpr):
    """1 / sqrt(mean(o^2) + eps) for a head of D outputs, the gated RMSNorm's scale."""
    return tl.rsqrt(sum_of_squares / D + eps)
