"""Triton kernels of the varlen (prefill) causal conv: one for the outputs, one for the new states.

Why two kernels: the output of token t reads up to W-1 rows of history, and the new state of a
slot overwrites those same rows. If one kernel did both, a program finishing early could overwrite
history that a program of another token block of the same sequence still has to read (a race
others shipped). Launched one after the other on the same stream, the output kernel reads only
the old history and the state kernel is the only writer.

Grid of the output kernel: axis x = token blocks of all sequences (a host-built table maps block
-> (sequence, first token)), axis y = channel blocks. Every tap j of the width-W filter is a
[BT, BC] tile load; the W tiles overlap by all but one row, so they hit L1/L2, not HBM.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def conv_varlen_out_kernel(
    x_ptr, stride_x_t,
    w_ptr, stride_w_c,
    state_ptr, stride_s_slot, stride_s_row, stride_s_c,
    y_ptr, stride_y_t,
    cu_ptr, idx_ptr, his_ptr,
    block_seq_ptr, block_t0_ptr,
    C, L,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    blk = tl.program_id(0)
    pc = tl.program_id(1)
    n = tl.load(block_seq_ptr + blk)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot <= 0:
        return
    bos = tl.load(cu_ptr + n).to(tl.int64)
    seq_len = (tl.load(cu_ptr + n + 1) - bos).to(tl.int32)
    has_hist = tl.load(his_ptr + n) != 0
    t0 = tl.load(block_t0_ptr + blk)

    offs_t = t0 + tl.arange(0, BT)                  # token positions inside the sequence
    offs_c = pc * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    mask_t = offs_t < seq_len
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        w_j = tl.load(w_ptr + offs_c * stride_w_c + j, mask=mask_c, other=0.0).to(tl.float32)
        p = offs_t - (W - 1) + j                    # source position; < 0 means history
        from_x = (p >= 0) & mask_t
        xv = tl.load(
            x_ptr + (bos + p)[:, None] * stride_x_t + offs_c[None, :],
            mask=from_x[:, None] & mask_c[None, :], other=0.0,
        ).to(tl.float32)
        # History row L+p (p in [-(W-1), -1]): the newest W-1 rows of the slot.
        from_h = (p < 0) & mask_t & has_hist
        hv = tl.load(
            state_ptr + slot * stride_s_slot + (L + p)[:, None] * stride_s_row + offs_c[None, :] * stride_s_c,
            mask=from_h[:, None] & mask_c[None, :], other=0.0,
        ).to(tl.float32)
        acc += (xv + hv) * w_j[None, :]
    y = acc / (1.0 + tl.exp(-acc))                  # SiLU
    tl.store(
        y_ptr + (bos + offs_t)[:, None] * stride_y_t + offs_c[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_c[None, :],
    )


@triton.jit
def conv_varlen_state_kernel(
    x_ptr, stride_x_t,
    state_ptr, stride_s_slot, stride_s_row, stride_s_c,
    cu_ptr, idx_ptr, his_ptr,
    C, L,
    BL: tl.constexpr, BC: tl.constexpr,
):
    """New state of sequence n = last L rows of (history if any, else zeros) ++ x, in place."""
    n = tl.program_id(0)
    pc = tl.program_id(1)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot <= 0:
        return
    bos = tl.load(cu_ptr + n).to(tl.int64)
    seq_len = (tl.load(cu_ptr + n + 1) - bos).to(tl.int32)
    has_hist = tl.load(his_ptr + n) != 0

    offs_r = tl.arange(0, BL)
    offs_c = pc * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    mask_r = offs_r < L
    p = seq_len - L + offs_r                        # source position of new row r
    from_x = (p >= 0) & mask_r
    xv = tl.load(
        x_ptr + (bos + p)[:, None] * stride_x_t + offs_c[None, :],
        mask=from_x[:, None] & mask_c[None, :], other=0.0,
    )
    from_h = (p < 0) & mask_r & has_hist
    base = state_ptr + slot * stride_s_slot + offs_c[None, :] * stride_s_c
    hv = tl.load(base + (L + p)[:, None] * stride_s_row, mask=from_h[:, None] & mask_c[None, :], other=0.0)
    new = tl.where(from_x[:, None], xv.to(state_ptr.dtype.element_ty), hv)
    # A short sequence shifts history rows within the slot: every thread must have read its
    # source row before any thread overwrites it.
    tl.debug_barrier()
    tl.store(base + offs_r[:, None] * stride_s_row, new, mask=mask_r[:, None] & mask_c[None, :])
