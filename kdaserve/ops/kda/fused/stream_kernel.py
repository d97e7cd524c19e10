"""The `stream` shape of the fused decode: one program per (sequence, head) that streams the head's
state through registers in [BV, K] tiles, for bandwidth-bound plain decode steps (many heads).

Why (docs/fused-decode.md, "Performance"): the split shapes give each V-slice program its own
copy of the head's q/k conv, l2norm and gate, and split heads meet through a workspace (an
arrival counter's fence + atomic round trip, or the finisher's wait). That lengthens every
program's life while its slot on the SM holds few state bytes in flight, so they move the state
slower than `chain`'s recurrence, whose [32, K] programs do nothing but the state. Here:
- one program per head computes q, k, v, the gate and beta once (no redundancy), rewrites the
  head's conv window at once (it is the only reader), and needs no workspace, counter or wait:
  it holds all D outputs of the head for the gated RMSNorm itself;
- the state goes through in D / BV tiles of [BV, K] (chain's tile: [32, K] of 4 warps), and the
  next tiles are in flight while the current one is computed: either STAGES-1 of them through a
  cp.async pipeline in shared memory (no register cost), or PREFETCH of them in registers; the
  first tiles are issued right after the slot is read, before the conv loads, so they fly while
  q/k are computed. A state tile is stored as soon as it is done (each tile's rows are
  independent).

Plain decode only (TOKENS = 1): verify keeps the split shapes (its tile stays in registers across
S+1 tokens). Rows whose slot is <= 0 read and write nothing (masks, as in the split kernel).

Grid axis x = N * H. The head's V outputs live in a [D / BV, BV] register tensor, filled tile by
tile with a select (tiny); v is computed for the whole head up front in the same shape.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.kda.fused.decode_kernel import _log_decay, _rewrite_conv, _silu_conv4, _taps, _window
from kdaserve.ops.triton_math import l2_normalize


@triton.jit
def _tile_load(ptr, mask, i: tl.constexpr, NT: tl.constexpr):
    """State tile i (fp32), or nothing (zeros, no load) past the last tile."""
    if i < NT:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.zeros(ptr.shape, tl.float32)


@triton.jit
def _tile_step(S, i, s_ptr, mask, tiles, v2, decay, k, q, beta, kq, o2):
    """The delta rule on state tile i (its BV rows): store the new tile, put its o rows into o2."""
    v = tl.sum(tl.where(tiles[:, None] == i, v2, 0.0), 0)  # this tile's v rows
    S = S * decay[None, :]
    u = beta * (v - tl.sum(S * k[None, :], 1))
    o = tl.sum(S * q[None, :], 1) + u * kq  # = S'' q, one pass over the tile
    S = S + u[:, None] * k[None, :]
    tl.store(s_ptr, S.to(s_ptr.dtype.element_ty), mask=mask)
    return tl.where(tiles[:, None] == i, o[None, :], o2)


@triton.jit
def kda_fused_stream_kernel(
    qkv, forget_logits, beta_logits, output_gate_logits, conv_w, A_log, dt_bias, norm_w,
    conv_state, state, state_indices, out,
    stride_qkv_t, stride_forget_t, stride_forget_h, stride_b_t, stride_b_h, stride_out_gate_t, stride_out_gate_h,
    stride_cs_slot, stride_cs_row, stride_cs_chan,
    stride_s_slot, stride_s_h, stride_s_v,
    stride_o_t, stride_o_h,
    lower_bound, norm_eps,
    H: tl.constexpr, D: tl.constexpr, L: tl.constexpr, SCALE: tl.constexpr,
    BOUNDED_GATE: tl.constexpr, BV: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
    WIN_REGS: tl.constexpr, GATE_DT: tl.constexpr = tl.float32,
):
    """Two ways to keep state bytes in flight:
    STAGES == 0: an unrolled loop over the tiles, each program holding PREFETCH (0..2) tiles in
      registers ahead of the one it computes (costs registers, hence programs per SM);
    STAGES >= 2: tiles 0..PREFETCH are loaded into registers first (they fly during the conv), the
      rest go through Triton's software pipeliner (num_stages=STAGES: cp.async into shared memory,
      STAGES-1 tiles in flight), so bytes in flight cost shared memory instead of registers.
    WIN_REGS: the conv rows are rewritten from the window registers (kept live across the tiles)
    instead of re-read from L1/L2 after them."""
    P: tl.constexpr = H * D
    NT: tl.constexpr = D // BV
    head = tl.program_id(0)  # = i_n * H + i_h
    i_n = head // H
    i_h = head % H
    d = tl.arange(0, D)
    c = i_h * D + d  # the head's channels within each of the q, k, v groups
    tiles = tl.arange(0, NT)
    rv = tl.arange(0, BV)
    d2 = tiles[:, None] * BV + rv[None, :]  # [NT, BV]: V index of (tile, row)

    # Slot first: the state tiles wait on it, everything else does not.
    slot = tl.load(state_indices + i_n).to(tl.int64)
    on = slot > 0  # padding rows (<= 0) are masked, not returned early: loads stay in flight
    s_base = state + i_h * stride_s_h + tl.maximum(slot, 0) * stride_s_slot
    s_tile = rv[:, None] * stride_s_v + d[None, :]  # [BV, K], K contiguous: 16-byte loads along K
    tile_step = BV * stride_s_v
    # The first tiles fly while the conv and the gate are computed.
    S0 = _tile_load(s_base + s_tile, on, 0, NT)
    if PREFETCH >= 1:
        S1 = _tile_load(s_base + tile_step + s_tile, on, 1, NT)
    if PREFETCH >= 2:
        S2 = _tile_load(s_base + 2 * tile_step + s_tile, on, 2, NT)

    wq0, wq1, wq2, wq3 = _taps(conv_w + c, P)
    wk0, wk1, wk2, wk3 = _taps(conv_w + 4 * P + c, P)
    wv0, wv1, wv2, wv3 = _taps(conv_w + 8 * P + c, P)
    a_log = tl.load(A_log + i_h).to(tl.float32)
    cs_slot = conv_state + tl.maximum(slot, 0) * stride_cs_slot
    win = cs_slot + (L - 3) * stride_cs_row  # the newest W-1 rows
    hq0, hq1, hq2 = _window(win + c * stride_cs_chan, stride_cs_row, on)
    hk0, hk1, hk2 = _window(win + (P + c) * stride_cs_chan, stride_cs_row, on)
    hv0, hv1, hv2 = _window(win + (2 * P + c) * stride_cs_chan, stride_cs_row, on)
    x_row = qkv + i_n.to(tl.int64) * stride_qkv_t
    xq = tl.load(x_row + c, mask=on, other=0.0).to(tl.float32)
    xk = tl.load(x_row + P + c, mask=on, other=0.0).to(tl.float32)
    xv = tl.load(x_row + 2 * P + c, mask=on, other=0.0).to(tl.float32)
    gk = _log_decay(forget_logits + i_n * stride_forget_t + i_h * stride_forget_h + d, dt_bias + i_h * D + d, a_log,
                    lower_bound, BOUNDED_GATE, GATE_DT)
    beta = tl.sigmoid(tl.load(beta_logits + i_n * stride_b_t + i_h * stride_b_h).to(tl.float32))
    q = l2_normalize(_silu_conv4(wq0, wq1, wq2, wq3, hq0, hq1, hq2, xq), SCALE)
    k = l2_normalize(_silu_conv4(wk0, wk1, wk2, wk3, hk0, hk1, hk2, xk), 1.0)
    v2 = tl.reshape(_silu_conv4(wv0, wv1, wv2, wv3, hv0, hv1, hv2, xv), (NT, BV))
    decay = tl.exp(gk)
    kq = tl.sum(k * q, 0)

    o2 = tl.zeros((NT, BV), tl.float32)
    if STAGES > 0:  # the tiles loaded early first, then the pipeline
        o2 = _tile_step(S0, 0, s_base + s_tile, on, tiles, v2, decay, k, q, beta, kq, o2)
        if PREFETCH >= 1 and NT > 1:
            o2 = _tile_step(S1, 1, s_base + tile_step + s_tile, on, tiles, v2, decay, k, q, beta, kq, o2)
        if PREFETCH >= 2 and NT > 2:
            o2 = _tile_step(S2, 2, s_base + 2 * tile_step + s_tile, on, tiles, v2, decay, k, q, beta, kq, o2)
        for i in tl.range(1 + PREFETCH, NT, num_stages=STAGES):
            S = tl.load(s_base + i * tile_step + s_tile, mask=on, other=0.0).to(tl.float32)
            o2 = _tile_step(S, i, s_base + i * tile_step + s_tile, on, tiles, v2, decay, k, q, beta, kq, o2)
    for i in tl.static_range(NT if STAGES == 0 else 0):
        S = S0
        if PREFETCH == 1:
            S0 = S1
            S1 = _tile_load(s_base + (i + 2) * tile_step + s_tile, on, i + 2, NT)
        elif PREFETCH == 2:
            S0 = S1
            S1 = S2
            S2 = _tile_load(s_base + (i + 3) * tile_step + s_tile, on, i + 3, NT)
        o2 = _tile_step(S, i, s_base + i * tile_step + s_tile, on, tiles, v2, decay, k, q, beta, kq, o2)
        if PREFETCH == 0:  # the next tile only after this one is stored: one tile in flight
            S0 = _tile_load(s_base + (i + 1) * tile_step + s_tile, on, i + 1, NT)

    gate_w = tl.sigmoid(tl.load(output_gate_logits + i_n * stride_out_gate_t + i_h * stride_out_gate_h + d2).to(tl.float32)) \
        * tl.load(norm_w + d2).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(tl.sum(o2 * o2, 1), 0) / D + norm_eps)
    tl.store(out + i_n * stride_o_t + i_h * stride_o_h + d2, (o2 * rstd * gate_w).to(out.dtype.element_ty), mask=on)

    # The whole head's conv window (q, k and v channels) at once, after the state: this program is
    # its only reader, and nothing waits on these stores (or the re-reads) before the tiles.
    g3 = tl.arange(0, 4)[:, None]  # 3 groups, padded to a power of two
    ch = g3 * P + c[None, :]
    grp = on & (g3 < 3)
    h0 = tl.where(g3 == 0, hq1[None, :], tl.where(g3 == 1, hk1[None, :], hv1[None, :]))
    h1 = tl.where(g3 == 0, hq2[None, :], tl.where(g3 == 1, hk2[None, :], hv2[None, :]))
    h2 = tl.where(g3 == 0, xq[None, :], tl.where(g3 == 1, xk[None, :], xv[None, :]))
    _rewrite_conv(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, ch, grp, i_n, L - 3,
                  h0, h1, h2, L, 1, WIN_REGS)
