"""Per-token-group FP8 quantization of activations (Triton): one program per (token, group).

    xq[t, c] = x[t, c] / s[t, g],   s[t, g] = max(max|x[t, group g]|, 1e-10) / 448

rounded to nearest even, as torch's float8_e4m3fn conversion (ops/fp8/reference.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.fp8.reference import FP8, FP8_MAX, SCALE_FLOOR


@triton.jit
def _quantize_group_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s,
                           GROUP: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = cols < K
    x = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR) / FMAX
    q = tl.clamp(x / s, -FMAX, FMAX)
    tl.store(q_ptr + t * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + t * stride_s + g, s)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (rows may be strided) -> (xq [T, K] float8_e4m3fn, s [T, ceil(K / group)] fp32)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"per-token-group quantization takes a [T, K] tensor with contiguous rows, got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")
    if group < 16 or group & (group - 1):
        raise ValueError(f"the quantization group must be a power of two >= 16, got {group}")
    interpreter_compat.install()
    T, K = x.shape
    q = torch.empty(T, K, dtype=FP8, device=x.device)
    s = torch.empty(T, triton.cdiv(K, group), dtype=torch.float32, device=x.device)
    if T:
        _quantize_group_kernel[(T, s.shape[1])](x, q, s, K, x.stride(0), q.stride(0), s.stride(0),
                                                GROUP=group, FMAX=FP8_MAX, FLOOR=SCALE_FLOOR, num_warps=1 if group <= 128 else 4)
    return q, s
