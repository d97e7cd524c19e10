"""The MoE experts through torch's grouped GEMM (torch.nn.functional.grouped_mm), for prefill:

    order  = the step's slots sorted by expert (stable: slot order within an expert)
    xs     = x[order // k]                                   one gather, [S, hidden]
    h      = swiglu(grouped_mm(xs, W13^T, offs))             each expert's rows a group, [S, I]
    y      = grouped_mm(h, W2^T, offs)                       [S, hidden], unweighted
    out[t] = sum_j weights[t, j] * y[rows[t*k + j]] (+ addend[t])    rows = order's inverse, fp32

On NVIDIA sm_90+ grouped_mm runs CUTLASS's warp-specialized grouped kernels (TMA loads overlapped
with the tensor cores), which Triton 3.6 does not build for the kernels of fused.py on Hopper.
Whether that beats fused.py at prefill sizes, and from how many tokens, is what
bench_moe_mla.py --moe-prefill-paths measures (docs/perf-notes.md); layers/moe runs this path only
from GROUPED_MM_MIN_TOKENS. The gather and the unfused SwiGLU cost memory traffic the fused kernels
avoid, so decode-sized steps stay with fused.py. Rounding as the reference's: each GEMM's output rounds to x's dtype (the
SwiGLU reads the rounded gate|up, the weights multiply the rounded down output) and the k
weighted rows sum in fp32 with the addend, rounded once. No host sync: the group offsets stay on
the device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdaserve.ops import interpreter_compat
from kdaserve.ops.activation.swiglu import swiglu_fwd
from kdaserve.ops.moe.fused import check_expert_shapes, sum_over_choices


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Where this path runs at CUTLASS speed: bf16 activations and weights on an NVIDIA GPU of
    compute capability 9.0 or later (elsewhere grouped_mm is a loop or absent)."""
    return (x.is_cuda and torch.version.hip is None and x.dtype == torch.bfloat16 and w13.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9 and hasattr(F, "grouped_mm"))


def expert_order(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (order [S]: slots sorted by expert, stable; rows [S]: order's inverse, slot s
    sits at row rows[s]; offs [E] int32: each expert's end row, cumulative)."""
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, rows, counts.cumsum(0, dtype=torch.int32)


def moe_experts_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor, activation_limit: float | None = None, *,
                           addend: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ops/moe/fused.moe_experts_fused without FP8 or a shared expert run as an
    expert: x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I], weights / ids [T, k] ->
    [T, hidden] in x's dtype, `addend` [T, hidden] added before the one rounding."""
    T, _, E, _ = check_expert_shapes("grouped-GEMM MoE", x, w13, w2, weights, ids, addend)
    k = ids.shape[1]
    if T * k == 0:
        return torch.zeros_like(x) if addend is None else addend.to(x.dtype, copy=True)
    interpreter_compat.install()
    order, rows, offs = expert_order(ids, E)
    xs = x.index_select(0, order // k)
    # grouped_mm's right operand is [groups, K, N]: the weights' transposed views (column-major),
    # the layout its kernels read without a copy.
    h = swiglu_fwd(F.grouped_mm(xs, w13.transpose(1, 2), offs=offs), activation_limit)
    y = F.grouped_mm(h, w2.transpose(1, 2), offs=offs)
    return sum_over_choices(y, T, k, x.dtype, addend, rows, weights.reshape(-1).float().contiguous())
