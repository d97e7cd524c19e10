"""DSA index scores in one Triton kernel: score[b, j, p] = sum_h w[b, j, h] relu(q[b, j, h] . K[b, p]
Di^-0.5), pools the query may not select at fp32's min. The torch form materialises the per-head
scores [B, n, Hi, P] in fp32 — 512 MiB for an 8K-token chunk over 8K tokens of context with 32
index heads, 8 GiB at 128K — where this kernel keeps a [BM, BP] tile in registers and walks the
heads: one program per (row, block of queries, block of pools) loads its pool keys once and the
queries of each head in turn (one tl.dot per head).

Products in fp32 (tl.dot with ieee precision for fp32 inputs; bf16 / fp16 inputs multiply exactly
into fp32): the sums differ from torch's only in order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat

FP32_MIN = torch.finfo(torch.float32).min


@triton.jit
def dsa_index_scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, out_ptr,
                            n, P, H, kpool, scale,
                            s_qb, s_qn, s_qh, s_wb, s_wn, s_kb, s_kp, s_pb, s_ob, s_on,
                            DI: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    pools = tl.program_id(2) * BP + tl.arange(0, BP)
    d = tl.arange(0, DI)
    row_ok = rows < n
    pool_ok = pools < P
    k = tl.load(k_ptr + b * s_kb + pools[None, :] * s_kp + d[:, None], mask=pool_ok[None, :], other=0.0)   # [DI, BP]
    acc = tl.zeros((BM, BP), dtype=tl.float32)
    for h in range(H):
        q = tl.load(q_ptr + b * s_qb + rows[:, None] * s_qn + h * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        w = tl.load(w_ptr + b * s_wb + rows * s_wn + h, mask=row_ok, other=0.0)
        acc += w[:, None] * tl.maximum(s * scale, 0.0)
    pos = tl.load(pos_ptr + b * s_pb + rows, mask=row_ok, other=0)
    ends = pools * kpool + (kpool - 1)
    acc = tl.where(ends[None, :] <= pos[:, None], acc, -3.4028234663852886e38)
    tl.store(out_ptr + b * s_ob + rows[:, None] * s_on + pools[None, :], acc, mask=row_ok[:, None] & pool_ok[None, :])


def dsa_index_scores_triton(q: torch.Tensor, w: torch.Tensor, pool_keys: torch.Tensor, positions: torch.Tensor,
                            kpool: int) -> torch.Tensor:
    """Same contract as ops/dsa/reference.dsa_index_scores_reference."""
    B, n, H, Di = q.shape
    P = pool_keys.shape[1]
    if Di < 16 or Di & (Di - 1):
        raise ValueError(f"the DSA scoring kernel needs a power-of-two index_head_dim >= 16, got {Di}; use the reference")
    interpreter_compat.install()
    out = torch.empty(B, n, P, dtype=torch.float32, device=q.device)
    if not (B and n and P):
        return out
    if pool_keys.dtype != q.dtype:
        pool_keys = pool_keys.to(q.dtype)
    q, pool_keys = q.contiguous(), pool_keys.contiguous()
    w, pos = w.float().contiguous(), positions.to(torch.int64).contiguous()
    BM, BP = 16 if n <= 16 else 64, 64
    grid = (B, triton.cdiv(n, BM), triton.cdiv(P, BP))
    dsa_index_scores_kernel[grid](q, w, pool_keys, pos, out, n, P, H, kpool, Di**-0.5,
                                  q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                                  pool_keys.stride(0), pool_keys.stride(1), pos.stride(0), out.stride(0), out.stride(1),
                                  DI=Di, BM=BM, BP=BP, IEEE=q.dtype == torch.float32)
    return out
