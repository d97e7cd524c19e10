"""Triton MLA decode over the paged latent cache, absorbed form (contract: reference.py).

One program per (row, group of BLOCK_H heads, split of the context): every head of the group scores
the same latent rows, so each tile of `TILE` cached tokens ([TILE, L] latent + [TILE, R] key part)
is read once for the group, with an online softmax in fp32. A row's tiles are divided among
`num_splits` programs (flash decoding) when rows x head groups alone would leave most of the GPU
idle (few rows, long contexts); each split then writes its normalized partial output and its
log-sum-exp, and a second launch merges them. The loop bounds are read on the device and the split
count depends only on host-known shapes (no host sync: CUDA graphs capture both launches); rows
past a context load zeros."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.precision import device_target, dot_precision, num_sms


@triton.jit
def _mla_decode_kernel(
    ql_ptr, qp_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, scale, num_splits,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_ob, stride_oh, stride_tb, stride_row,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, HAS_PE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    hg = tl.program_id(1)
    sp = tl.program_id(2)
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
    per_split = (num_tiles + num_splits - 1) // num_splits
    for i in range(sp * per_split, tl.minimum(sp * per_split + per_split, num_tiles)):
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
    if SPLIT:   # partial [B, H, splits, L] fp32 and its log-sum-exp (-inf: an empty split)
        part = (b * H + heads).to(tl.int64) * num_splits + sp
        tl.store(part_ptr + part[:, None] * L + offs_l[None, :], out, mask=h_ok[:, None])
        tl.store(lse_ptr + part, tl.where(l > 0, m + tl.log(tl.maximum(l, 1e-30)), float("-inf")), mask=h_ok)
    else:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def _mla_merge_kernel(part_ptr, lse_ptr, out_ptr, num_splits, stride_ob, stride_oh,
                      H: tl.constexpr, L: tl.constexpr, SPLITS: tl.constexpr):
    """out[b, h] = sum_s exp(lse_s - lse) * part_s, lse = log sum_s exp(lse_s): one program per
    (row, head). A row whose every split is empty (no context) gets zeros, as the one-launch path."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * H + h).to(tl.int64) * num_splits
    offs_s = tl.arange(0, SPLITS)
    lse = tl.load(lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(lse - top), 0)
    offs_l = tl.arange(0, L)
    acc = tl.zeros([L], tl.float32)
    for s in range(num_splits):
        w = tl.exp(tl.load(lse_ptr + base + s) - top)
        acc += w * tl.load(part_ptr + (base + s) * L + offs_l)
    out = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_l, out.to(out_ptr.dtype.element_ty))


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


def dense_launch(target: str, L: int) -> tuple[int, int, int, int]:
    """(tokens per tile, warps, stages, heads per program) of the dense decode on `target`. On
    Hopper and later at L >= 256: 32 heads per program (each latent tile read once for twice the
    heads), 64-token tiles in 4 warps and 2 stages, two programs per SM: the sweep's fastest
    (docs/perf-notes.md), though it spills a few bytes on sm_90; it needs Hopper's shared memory.
    Elsewhere: launch_shape with 16 heads."""
    if target.startswith("sm_") and int(target[3:]) >= 90 and L >= 256:
        return 64, 4, 2, 32
    return (*launch_shape(target, L), 16)


# Splits: as many as keep all programs within one wave of SPLIT_SLOTS_PER_SM programs per
# multiprocessor (a partial second wave cost up to 1.5x in the sweep), each split at least
# MIN_SPLIT_TILES tiles of the widest table (writing and merging partials costs more than it
# spreads), at most MAX_SPLITS (the merge's loop and the partials' memory).
SPLIT_SLOTS_PER_SM, MIN_SPLIT_TILES, MAX_SPLITS = 2, 4, 64


def choose_splits(device: torch.device, rows: int, head_groups: int, table_tokens: int, tile: int) -> int:
    """Context splits per (row, head group) from host-known shapes only (no look at the lengths)."""
    fit = SPLIT_SLOTS_PER_SM * num_sms(device) // max(1, rows * head_groups)
    return max(1, min(fit, MAX_SPLITS, -(-table_tokens // tile) // MIN_SPLIT_TILES))


def mla_decode_triton(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, *, num_splits: int | None = None,
                      block_h: int | None = None, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Same contract as reference.mla_decode_reference. `num_splits` (default: choose_splits),
    `block_h` (heads per program) and `launch` (tile, warps, stages), default dense_launch, are for
    tests and benchmark sweeps."""
    B, H, L = q_latent.shape
    R = q_pe.shape[-1]
    check_latent_sizes("MLA decode", cache, L, R)
    block_size = cache.shape[1]
    interpreter_compat.install()
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_pe = q_pe if R == 0 or q_pe.stride(-1) == 1 else q_pe.contiguous()
    q_latent, q_pe = q_latent.to(cache.dtype), q_pe.to(cache.dtype)
    out = torch.empty(B, H, L, dtype=cache.dtype, device=cache.device)
    *default, default_bh = dense_launch(device_target(cache.device), L)
    tile, warps, stages = launch or default
    block_h = block_h or min(default_bh, max(16, triton.next_power_of_2(H)))
    groups = triton.cdiv(H, block_h)
    if num_splits is None:
        num_splits = choose_splits(cache.device, B, groups, block_tables.shape[1] * block_size, tile)
    split = num_splits > 1
    part = torch.empty(B, H, num_splits, L, dtype=torch.float32, device=cache.device) if split else out
    lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=cache.device) if split else out
    _mla_decode_kernel[(B, groups, num_splits)](
        q_latent, q_pe, cache, block_tables, context_lens, out, part, lse, scale, num_splits,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), cache.stride(1),
        H=H, L=L, R=max(R, 16), HAS_PE=R > 0, BLOCK_H=block_h, BLOCK_SIZE=block_size, TILE=tile,
        PREC="ieee" if cache.dtype == torch.float32 else dot_precision(cache.device).tensor_core, SPLIT=split,
        num_warps=warps, num_stages=stages,
    )
    if split:
        _mla_merge_kernel[(B, H)](part, lse, out, num_splits, out.stride(0), out.stride(1), H=H, L=L,
                                  SPLITS=triton.next_power_of_2(num_splits), num_warps=4)
    return out
