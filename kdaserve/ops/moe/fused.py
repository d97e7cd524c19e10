"""The fused MoE path: two grouped GEMMs over the step's slots sorted by expert (align.py).

    gate_up: h[s]   = silu(x[s // k] W1[e]^T) * (x[s // k] W3[e]^T)       one program per
             (block of block_m sorted slots of expert e, block of the intermediate width)
    down:    y[s]   = w[s] * h[s] W2[e]^T                                  same, over hidden
    out[t]  = sum_j y[t*k + j]                                             in fp32, in torch

Each expert's weights are read once per block of its tokens, and the gate and up halves of one
intermediate column block are computed by the same program (the SiLU product is its epilogue).
The final sum is a reshape and a sum over k: no atomics, so results do not depend on timing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.precision import dot_precision
from kdaserve.ops.moe.align import align_to_experts


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, sorted_ptr, experts_ptr, h_ptr,
    S, HIDDEN, INTER, stride_x, stride_we, stride_wn, stride_h,
    TOPK: tl.constexpr, LIMIT: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    slots = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = slots < S
    tokens = tl.where(valid, slots // TOPK, 0).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < INTER
    w_base = w_ptr + e.to(tl.int64) * stride_we
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, HIDDEN, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < HIDDEN
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w_base + (cols + INTER)[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, LIMIT)
        acc_u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out = h_ptr + slots.to(tl.int64)[:, None] * stride_h + cols[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, sorted_ptr, experts_ptr, weights_ptr, y_ptr,
    S, HIDDEN, INTER, stride_h, stride_we, stride_wn, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    slots = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = slots < S
    rows = tl.where(valid, slots, 0).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < HIDDEN
    w_base = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, INTER, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < INTER
        a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PREC)
    acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def moe_block_m(num_slots: int, num_experts: int) -> int:
    """Rows per program: small when each expert gets few tokens (decode), where padding to a
    large block would multiply the work, large when experts get many (prefill)."""
    per_expert = num_slots / max(1, min(num_slots, num_experts))
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def moe_experts_fused(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, activation_limit: float | None = None) -> torch.Tensor:
    """Same contract as ops/moe/reference.moe_experts_reference: x [T, hidden] -> [T, hidden]."""
    T, hidden = x.shape
    E, two_inter, hidden_w = w13.shape
    inter = two_inter // 2
    if hidden_w != hidden or tuple(w2.shape) != (E, hidden, inter) or ids.shape != weights.shape:
        raise ValueError(f"fused MoE needs x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I] and [T, k] weights/ids; "
                         f"got x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    interpreter_compat.install()
    k = ids.shape[1]
    S = T * k
    out_dtype = x.dtype
    x = x if x.stride(1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    if S == 0:
        return torch.zeros_like(x)
    BM = moe_block_m(S, E)
    sorted_slots, block_experts = align_to_experts(ids, E, BM)
    prec = "ieee" if x.dtype == torch.float32 else dot_precision(x.device).tensor_core
    h = torch.empty(S, inter, dtype=x.dtype, device=x.device)
    BN1, BK1 = _block(inter, 64), _block(hidden, 64)
    _moe_gate_up_kernel[(block_experts.numel(), triton.cdiv(inter, BN1))](
        x, w13, sorted_slots, block_experts, h, S, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOPK=k, LIMIT=float(activation_limit or 0.0), HAS_LIMIT=activation_limit is not None,
        BM=BM, BN=BN1, BK=BK1, PREC=prec, num_warps=4,
    )
    y = torch.empty(S, hidden, dtype=torch.float32 if x.dtype == torch.float32 else x.dtype, device=x.device)
    BN2, BK2 = _block(hidden, 64), _block(inter, 64)
    _moe_down_kernel[(block_experts.numel(), triton.cdiv(hidden, BN2))](
        h, w2, sorted_slots, block_experts, weights.reshape(-1).float().contiguous(), y,
        S, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BM=BM, BN=BN2, BK=BK2, PREC=prec, num_warps=4,
    )
    return y.view(T, k, hidden).sum(1, dtype=torch.float32).to(out_dtype)
