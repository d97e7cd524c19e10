"""Triton MLA decode over a chosen set of context tokens (DeepSeek sparse attention: GLM-5.3-Flash),
absorbed form. Same contract as reference.mla_decode_reference with `allowed` built from the token
positions, but reading only those positions: index_topk + kpool - 1 cached rows per decode row,
whatever the context length.

One program per (row, group of BLOCK_H heads), tiles of TILE chosen positions (-1 = none): each
position goes through the row's block table to its cache row; the latent tile is read once for
the head group, online softmax in fp32. Models without a rotary key part (R = 0, GLM) skip it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.mla.decode import check_latent_sizes, launch_shape
from kdaserve.ops.precision import device_target, dot_precision


@triton.jit
def _mla_sparse_decode_kernel(
    ql_ptr, qp_ptr, cache_ptr, tables_ptr, idx_ptr, out_ptr, scale, K,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_ob, stride_oh, stride_tb, stride_ib, stride_row,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, HAS_PE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hg = tl.program_id(1)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_l = tl.arange(0, L)
    ql = tl.load(ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + offs_l[None, :], mask=h_ok[:, None], other=0.0)
    if HAS_PE:
        offs_r = tl.arange(0, R)
        qp = tl.load(qp_ptr + b * stride_qpb + heads[:, None] * stride_qph + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L], tl.float32)
    for i in range(0, K, TILE):
        j = i + tl.arange(0, TILE)
        t = tl.load(idx_ptr + b * stride_ib + j, mask=j < K, other=-1)
        t_ok = t >= 0
        t = tl.maximum(t, 0)
        blk = tl.load(tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=t_ok, other=0)
        rows = (blk.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE) * stride_row
        lat = tl.load(cache_ptr + rows[:, None] + offs_l[None, :], mask=t_ok[:, None], other=0.0)
        s = tl.dot(ql, tl.trans(lat).to(ql.dtype), input_precision=PREC)
        if HAS_PE:
            pe = tl.load(cache_ptr + rows[:, None] + L + offs_r[None, :], mask=t_ok[:, None], other=0.0)
            s = tl.dot(qp, tl.trans(pe).to(qp.dtype), s, input_precision=PREC)
        s = tl.where(t_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a tile with nothing chosen yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PREC)
        m = m_new
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None])


def mla_sparse_decode_triton(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                             block_tables: torch.Tensor, token_idx: torch.Tensor, scale: float) -> torch.Tensor:
    """q_latent [B, H, L], q_pe [B, H, R] (R may be 0), cache [NB, BS, L+R], block_tables [B, width],
    token_idx [B, K] int32 context positions (-1: none; each row needs at least one) -> [B, H, L]."""
    B, H, L = q_latent.shape
    R = q_pe.shape[-1]
    check_latent_sizes("sparse MLA decode", cache, L, R)
    block_size = cache.shape[1]
    interpreter_compat.install()
    q_latent = (q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()).to(cache.dtype)
    q_pe = (q_pe if R == 0 or q_pe.stride(-1) == 1 else q_pe.contiguous()).to(cache.dtype)
    token_idx = token_idx.to(torch.int32).contiguous()
    out = torch.empty(B, H, L, dtype=cache.dtype, device=cache.device)
    if B == 0:
        return out
    BLOCK_H = 16
    tile, warps, stages = launch_shape(device_target(cache.device), L)
    _mla_sparse_decode_kernel[(B, triton.cdiv(H, BLOCK_H))](
        q_latent, q_pe if R else q_latent, cache, block_tables, token_idx, out, scale, token_idx.shape[1],
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0) if R else 0, q_pe.stride(1) if R else 0,
        out.stride(0), out.stride(1), block_tables.stride(0), token_idx.stride(0), cache.stride(1),
        H=H, L=L, R=max(R, 16), HAS_PE=R > 0, BLOCK_H=BLOCK_H, BLOCK_SIZE=block_size, TILE=tile,
        PREC="ieee" if cache.dtype == torch.float32 else dot_precision(cache.device).tensor_core, num_warps=warps,
        num_stages=stages,
    )
    return out
