"""Triton paged decode attention: one query token per row over its cached context, GQA.

One program per (row, KV head) on grid axis x; it walks the row's context in tiles of
`TILE` tokens (gathering block ids from the block table), with an online softmax in fp32, so the
cost follows each row's real context length and not the block table's width. The loop bound is
read on the device (no host sync), so CUDA graphs can capture it. Rows past the context, and
padding rows, load zeros: garbage in unused cache rows never reaches the output.

Caches `[num_blocks, block_size, Hkv, D]` (contiguous); q and out `[B, Hq, D]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.precision import dot_precision


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_tb,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    q_rows = q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=g_ok[:, None], other=0.0).to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    row_stride = HKV * D
    num_tiles = (ctx + TILE - 1) // TILE
    for i in range(num_tiles):
        t = i * TILE + tl.arange(0, TILE)
        t_ok = t < ctx
        blk = tl.load(tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=t_ok, other=0)
        rows = (blk.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE) * row_stride + h * D
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m = m_new
    out = acc / tl.maximum(l, 1e-30)[:, None]
    o_rows = out_ptr + b * stride_ob + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def paged_decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [B, Hq, D] -> out [B, Hq, D]; context_lens [B] int32 (>= 1), block_tables [B, width] int32."""
    B, Hq, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    if Dk != D or Hq % Hkv or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError(
            f"paged decode attention needs contiguous caches [blocks, block_size, Hkv, {D}] with Hq % Hkv == 0; "
            f"got q {tuple(q.shape)}, cache {tuple(k_cache.shape)} (contiguous: {k_cache.is_contiguous()})"
        )
    if D & (D - 1) or D < 16:
        raise ValueError(f"paged decode attention needs a power-of-two head_dim >= 16, got {D}")
    interpreter_compat.install()
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty_like(q)
    G = Hq // Hkv
    _paged_decode_kernel[(B * Hkv,)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK_SIZE=block_size, TILE=64,
        # fp32 models get exact fp32 dots; for 16-bit caches tf32 loses nothing the cache kept.
        PREC="ieee" if q.dtype == torch.float32 else dot_precision(q.device).tensor_core,
        num_warps=4,
    )
    return out
