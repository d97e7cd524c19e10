"""Triton MLA decode over the paged latent cache, absorbed form (contract: reference.py).

One program per (row, group of BLOCK_H heads): every head of the group scores the same latent rows,
so each tile of `TILE` cached tokens ([TILE, L] latent + [TILE, R] key part) is read once for the
group, with an online softmax in fp32. The loop bound is read on the device (no host sync: CUDA
graphs capture it); rows past a context load zeros."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.precision import device_target, dot_precision


@triton.jit
def _mla_decode_kernel(
    ql_ptr, qp_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, scale,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_ob, stride_oh, stride_tb, stride_row,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, HAS_PE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    hg = tl.program_id(1)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    ql = tl.load(ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + offs_l[None, :], mask=h_ok[:, None], other=0.0)
    if HAS_PE:
        qp = tl.load(qp_ptr + b * stride_qpb + heads[:, None] * stride_qph + offs_r[None, :], mask=h_ok[:, None],
                     other=0.0)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L], tl.float32)
    num_tiles = (ctx + TILE - 1) // TILE
    for i in range(num_tiles):
        t = i * TILE + tl.arange(0, TILE)
        t_ok = t < ctx
        blk = tl.load(tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=t_ok, other=0)
        rows = (blk.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE) * stride_row
        lat = tl.load(cache_ptr + rows[:, None] + offs_l[None, :], mask=t_ok[:, None], other=0.0)
        s = tl.dot(ql, tl.trans(lat).to(ql.dtype), input_precision=PREC)
        if HAS_PE:
            pe = tl.load(cache_ptr + rows[:, None] + L + offs_r[None, :], mask=t_ok[:, None], other=0.0)
            s = tl.dot(qp, tl.trans(pe).to(qp.dtype), s, input_precision=PREC)
        s = s * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PREC)
        m = m_new
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None])


def launch_shape(target: str, L: int) -> tuple[int, int, int]:
    """(tokens per tile, warps, pipeline stages) on `target` (ops/precision.device_target): on AMD
    (wave64) 16-token tiles in 4 waves are the shape that spills on neither gfx942 nor gfx950 at
    L = 512 (tools/compile_check.py)."""
    if target.startswith("gfx"):
        return 16, 4, 2
    return 32, 4 if L <= 128 else 8, 3


def check_latent_sizes(kernel: str, cache: torch.Tensor, L: int, R: int) -> None:
    """What the absorbed kernels (this one and sparse_decode.py) take: a contiguous latent cache
    [blocks, block_size, L+R], L a power of two >= 16, R 0 or a power of two >= 16."""
    if cache.shape[-1] != L + R or not cache.is_contiguous():
        raise ValueError(f"{kernel} needs a contiguous cache [blocks, block_size, L+R = {L + R}], got "
                         f"{tuple(cache.shape)} (contiguous: {cache.is_contiguous()})")
    if L < 16 or L & (L - 1) or (R != 0 and (R < 16 or R & (R - 1))):
        raise ValueError(f"{kernel} needs a power-of-two kv_lora_rank >= 16 (got {L}) and a rope key part of 0 or a "
                         f"power of two >= 16 (got {R})")


def mla_decode_triton(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as reference.mla_decode_reference."""
    B, H, L = q_latent.shape
    R = q_pe.shape[-1]
    check_latent_sizes("MLA decode", cache, L, R)
    block_size = cache.shape[1]
    interpreter_compat.install()
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_pe = q_pe if R == 0 or q_pe.stride(-1) == 1 else q_pe.contiguous()
    q_latent, q_pe = q_latent.to(cache.dtype), q_pe.to(cache.dtype)
    out = torch.empty(B, H, L, dtype=cache.dtype, device=cache.device)
    BLOCK_H = 16
    tile, warps, stages = launch_shape(device_target(cache.device), L)
    _mla_decode_kernel[(B, triton.cdiv(H, BLOCK_H))](
        q_latent, q_pe, cache, block_tables, context_lens, out, scale,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), cache.stride(1),
        H=H, L=L, R=max(R, 16), HAS_PE=R > 0, BLOCK_H=BLOCK_H, BLOCK_SIZE=block_size, TILE=tile,
        PREC="ieee" if cache.dtype == torch.float32 else dot_precision(cache.device).tensor_core, num_warps=warps,
        num_stages=stages,
    )
    return out
