"""Gated RMSNorm per head: y = o * rsqrt(mean(o^2) + eps) * weight * sigmoid(output_gate_logits), fp32 math.

Design (why):
- One program normalizes BR rows of D (a row = one token-head), so a program moves a few KB and
  the grid (axis x) scales with T*H: small D per row would leave most lanes idle otherwise.
- Rows are addressed as (token, head) with separate strides, so o, output_gate_logits and out may be views
  ([T, P] or [T, H, D], column slices) without copies; only the last dim must be contiguous.
- `row_state_indices` lets decode skip padding rows (slot <= 0) with nothing written, as the
  contract demands; `tokens_per_index` maps S+1 tokens of a speculative row to one index (and the
  index tensor may be a strided column, e.g. spec_state_indices[:, 0]), so no expansion copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops.triton_math import rms_rstd


@triton.jit
def gated_rms_norm_kernel(
    o_ptr, stride_o_t, stride_o_h,
    g_ptr, stride_g_t, stride_g_h,
    w_ptr,
    y_ptr, stride_y_t, stride_y_h,
    idx_ptr, stride_idx,
    n_rows, H, D, eps,
    tokens_per_index,
    HAS_INDEX: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    t = rows // H
    h = rows % H
    mask_r = rows < n_rows
    if HAS_INDEX:
        slot = tl.load(idx_ptr + (t // tokens_per_index) * stride_idx, mask=mask_r, other=0)
        mask_r = mask_r & (slot > 0)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    mask = mask_r[:, None] & mask_d[None, :]
    o = tl.load(o_ptr + (t * stride_o_t + h * stride_o_h)[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + (t * stride_g_t + h * stride_g_h)[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    rstd = rms_rstd(tl.sum(o * o, axis=1), eps, D)
    y = o * rstd[:, None] * w[None, :] * tl.sigmoid(g)
    tl.store(y_ptr + (t * stride_y_t + h * stride_y_h)[:, None] + offs_d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def as_head_view(t: torch.Tensor, T: int, H: int, D: int, name: str) -> torch.Tensor:
    """A [T, H, D] view of a [T, H, D] or [T, P] tensor (no copy); last dim must be contiguous."""
    if t.dim() == 2:
        _expect(tuple(t.shape) == (T, H * D) and t.stride(1) == 1,
                f"{name} must be [T, P] = [{T}, {H * D}] with contiguous columns, got {tuple(t.shape)} strides {t.stride()}")
        return t.view(T, H, D) if t.stride(0) == H * D else t.as_strided((T, H, D), (t.stride(0), D, 1))
    _expect(tuple(t.shape) == (T, H, D) and t.stride(2) == 1,
            f"{name} must be [T, H, D] = [{T}, {H}, {D}] with a contiguous last dim, got {tuple(t.shape)} strides {t.stride()}")
    return t


def gated_rms_norm_fwd(
    o: torch.Tensor,
    output_gate_logits: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    *,
    row_state_indices: torch.Tensor | None = None,
    tokens_per_index: int = 1,
) -> torch.Tensor:
    """o [T, H, D] (any float dtype), output_gate_logits [T, H, D] or [T, P], weight [D] -> out [T, H, D] (or [T, P]).

    Rows (tokens) t with row_state_indices[t // tokens_per_index] <= 0 are not written.
    """
    _expect(o.dim() == 3, f"o must be [T, H, D], got {tuple(o.shape)}")
    T, H, D = o.shape
    o = as_head_view(o, T, H, D, "o")
    g = as_head_view(output_gate_logits, T, H, D, "output_gate_logits")
    y = as_head_view(out, T, H, D, "out")
    _expect(weight.shape == (D,) and weight.stride(0) == 1, f"weight must be a contiguous [D] = [{D}], got {tuple(weight.shape)}")
    if row_state_indices is not None:
        _expect(row_state_indices.dim() == 1 and row_state_indices.shape[0] * tokens_per_index == T,
                f"row_state_indices must be [T / tokens_per_index] = [{T // max(tokens_per_index, 1)}], got "
                f"{tuple(row_state_indices.shape)}")
    if T * H == 0:
        return out
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 4096 // BD))
    idx = row_state_indices if row_state_indices is not None else o  # dummy pointer when unused
    gated_rms_norm_kernel[(triton.cdiv(T * H, BR),)](
        o, o.stride(0), o.stride(1),
        g, g.stride(0), g.stride(1),
        weight,
        y, y.stride(0), y.stride(1),
        idx, idx.stride(0) if row_state_indices is not None else 0,
        T * H, H, D, eps,
        tokens_per_index,
        HAS_INDEX=row_state_indices is not None, BR=BR, BD=BD,
    )
    return out
