"""Triton kernel of the decode / speculative conv update (m new rows per sequence, in place).

One program owns one (sequence, channel block): it gathers everything it needs (the W-1+m window
for the outputs and the L rows of the new state, from history and from x) into registers, then
a barrier, then stores. No other program touches that slot's channels, and inside the program no
thread stores before every thread has loaded, so the in-place window shift cannot race whatever
the grid size (the failure others hit when several programs shared one sequence's window).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def conv_update_kernel(
    x_ptr, stride_x_t,
    w_ptr, stride_w_c,
    state_ptr, stride_s_slot, stride_s_row, stride_s_c,
    y_ptr, stride_y_t,
    idx_ptr, acc_ptr,
    C, L, m,
    W: tl.constexpr, BM: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr,
    HAS_ACCEPTED: tl.constexpr,
):
    n = tl.program_id(0)
    pc = tl.program_id(1)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot <= 0:
        return
    if HAS_ACCEPTED:
        # Resume after the accepted drafts. The count is clamped to [1, L-W+2] (as in the fused
        # kernel): an out-of-range value from a buggy caller must not read a neighbouring slot.
        accepted = tl.minimum(tl.maximum(tl.load(acc_ptr + n).to(tl.int32), 1), L - W + 2)
        offset = accepted - 1
    else:
        offset = L - (W - 1)                             # the newest W-1 rows
    row0 = n.to(tl.int64) * m                            # first x row of this sequence
    offs_c = pc * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    hist = state_ptr + slot * stride_s_slot + offs_c[None, :] * stride_s_c
    xrow = x_ptr + offs_c[None, :]

    # Outputs: window index q = i + j; q < W-1 is history row offset+q, else x row q-(W-1).
    offs_i = tl.arange(0, BM)
    mask_i = offs_i < m
    acc = tl.zeros([BM, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        w_j = tl.load(w_ptr + offs_c * stride_w_c + j, mask=mask_c, other=0.0).to(tl.float32)
        q = offs_i + j
        in_h = mask_i & (q < W - 1)
        in_x = mask_i & (q >= W - 1)
        hv = tl.load(hist + (offset + q)[:, None] * stride_s_row, mask=in_h[:, None] & mask_c[None, :], other=0.0)
        xv = tl.load(xrow + (row0 + q - (W - 1))[:, None] * stride_x_t, mask=in_x[:, None] & mask_c[None, :], other=0.0)
        acc += (hv.to(tl.float32) + xv.to(tl.float32)) * w_j[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + (row0 + offs_i)[:, None] * stride_y_t + offs_c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask_i[:, None] & mask_c[None, :])

    # New state: row r is kept[k], k = offset + W-1 + m - L + r, of kept = hist[:offset+W-1] ++ x.
    offs_r = tl.arange(0, BL)
    mask_r = offs_r < L
    k = offset + (W - 1) + m - L + offs_r
    from_h = mask_r & (k < offset + (W - 1))
    from_x = mask_r & (k >= offset + (W - 1))
    hv = tl.load(hist + k[:, None] * stride_s_row, mask=from_h[:, None] & mask_c[None, :], other=0.0)
    xv = tl.load(xrow + (row0 + k - offset - (W - 1))[:, None] * stride_x_t, mask=from_x[:, None] & mask_c[None, :], other=0.0)
    new = tl.where(from_x[:, None], xv.to(state_ptr.dtype.element_ty), hv)
    tl.debug_barrier()  # every source row read before any row of the slot is overwritten
    tl.store(hist + offs_r[:, None] * stride_s_row, new, mask=mask_r[:, None] & mask_c[None, :])
