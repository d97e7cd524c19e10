"""Scan of segment maps: the exact start state of every segment of a sequence.

Segment s maps its start state to its end state affinely, S_end = S_start M_s + B_s (M_s [K, K]
and B_s [V, K] from the map pass). One program per (sequence, head, V-slice) walks the sequence's
segments in order: start_{s+1} = start_s M_s + B_s, beginning with the first segment's end state
(computed from the true initial state, so it needs no map), and writes the last end state into the
pool. The product is one [BV, K] x [K, K] dot per segment in tf32x3 (fp32-accurate on tensor
cores): these states feed every later output of the sequence, so they get full precision.
State checkpoints (recurrence.py, NCK > 0) in a later segment are written here: at its start the
start state, inside it S_start M_o + B_o from the partial maps the map pass stored at the offset
(same tf32x3 dot).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def flash_scan_kernel(
    bm_ptr, start_ptr,
    s_ptr, stride_s_slot, stride_s_h, stride_s_v,
    idx_ptr, seq_seg0_ptr,
    ck_off_ptr, ck_slot_ptr, ck_maps_ptr, SL,
    H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, NCK: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    NV: tl.constexpr = D // BV
    vs = pid % NV
    h = (pid // NV) % H
    n = pid // (NV * H)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot <= 0:
        return
    s0 = tl.load(seq_seg0_ptr + n)
    s1 = tl.load(seq_seg0_ptr + n + 1)
    if s1 - s0 <= 1:
        return  # one segment: the map pass already wrote the final state
    rows = vs * BV + tl.arange(0, BV)
    kcols = tl.arange(0, D)
    mrow = tl.arange(0, D)
    tile = rows[:, None] * D + kcols[None, :]
    S = tl.load(bm_ptr + ((s0.to(tl.int64) * 2 + 0) * H + h) * (D * D) + tile)
    for s in range(s0 + 1, s1):
        tl.store(start_ptr + (s * H + h).to(tl.int64) * (D * D) + tile, S)
        if NCK > 0:   # checkpoints at this segment's start or inside it (a runtime loop: NCK can be wide)
            seg_tok = (s - s0) * SL
            for j in range(NCK):
                o = tl.load(ck_off_ptr + n * NCK + j)
                ck = tl.load(ck_slot_ptr + n * NCK + j).to(tl.int64)
                if (ck > 0) & (o >= seg_tok) & (o < seg_tok + SL):
                    S_ck = S
                    if o > seg_tok:
                        maps = ck_maps_ptr + (n.to(tl.int64) * NCK + j) * 2 * (H * D * D) + h * (D * D)
                        M_o = tl.load(maps + H * D * D + mrow[:, None] * D + kcols[None, :])
                        S_ck = tl.dot(S, M_o, acc=tl.load(maps + tile), input_precision=PREC)
                    tl.store(s_ptr + ck * stride_s_slot + h * stride_s_h + rows[:, None] * stride_s_v + kcols[None, :],
                             S_ck.to(s_ptr.dtype.element_ty))
        M = tl.load(bm_ptr + ((s * 2 + 1) * H + h).to(tl.int64) * (D * D) + mrow[:, None] * D + kcols[None, :])
        B = tl.load(bm_ptr + ((s * 2 + 0) * H + h).to(tl.int64) * (D * D) + tile)
        S = tl.dot(S, M, acc=B, input_precision=PREC)
    tl.store(s_ptr + slot * stride_s_slot + h * stride_s_h + rows[:, None] * stride_s_v + kcols[None, :],
             S.to(s_ptr.dtype.element_ty))
