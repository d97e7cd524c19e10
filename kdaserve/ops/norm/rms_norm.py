"""RMSNorm of a decoder layer's hidden states, optionally fused with the residual add before it:

    residual' = round(x + residual)                    (fp32 add, rounded to x's dtype)
    y         = round(residual' * rsqrt(mean(residual'^2) + eps) * weight)     (fp32 math)

the definition is layers/norm.RMSNorm's torch path (the model families' reference). One pass over
the rows, where the torch path launches ~7 kernels (upcasts, the add, the square, the mean, the
products, the downcast) that each read or write the rows (what that cost: docs/perf-notes.md).

One program normalizes BR rows of D; rows may be strided (a column slice of a wider tensor), the
last dim must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat


@triton.jit
def rms_norm_kernel(
    x_ptr, stride_x, r_ptr, stride_r, w_ptr, y_ptr, stride_y, ro_ptr, stride_ro,
    n_rows, D, eps,
    HAS_RESIDUAL: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s = (x + tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32))
        s = s.to(ro_ptr.dtype.element_ty)   # the new residual stream, in the stream's dtype
        tl.store(ro_ptr + rows[:, None] * stride_ro + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)                # normalized as stored, as the torch path does
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def launch_shape(D: int) -> tuple[int, int, int]:
    """(rows per program, padded width, warps): ~4K elements per program, 16 per thread at most."""
    BD = triton.next_power_of_2(D)
    return max(1, min(16, 4096 // BD)), BD, 4 if BD <= 1024 else 8 if BD <= 4096 else 16


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """A [rows, D] view with a contiguous last dim (a copy only where no view exists)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.reshape(-1, D)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as layers/norm.RMSNorm.forward: norm(x), or with `residual` (norm(x + residual),
    x + residual) with the new residual stream in x's dtype. x [..., D], weight [D]."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"RMSNorm weight must be [{D}] for inputs [..., {D}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"the residual must have the input's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    interpreter_compat.install()
    x2 = _rows(x, D)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = ro = x2   # unused pointers when there is no residual
    if residual is not None:
        r2 = _rows(residual, D)
        ro = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[0]
    if n:
        BR, BD, warps = launch_shape(D)
        rms_norm_kernel[(triton.cdiv(n, BR),)](
            x2, x2.stride(0), r2, r2.stride(0), weight if weight.stride(0) == 1 else weight.contiguous(),
            y, y.stride(0), ro, ro.stride(0), n, D, eps,
            HAS_RESIDUAL=residual is not None, BR=BR, BD=BD, num_warps=warps,
        )
    y = y.view(x.shape)
    return y if residual is None else (y, ro.view(x.shape))
