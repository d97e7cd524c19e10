"""The single-launch KDA decode kernel: conv update + SiLU, l2norm, gate, beta, delta rule on the
paged state, gated RMSNorm, all in one launch.

Grid axis x = N * H * SPLIT programs (sequences x heads x V-slices; axis z caps at 65,535). Each
program owns BV = D / SPLIT rows (V) of its head's [V, K] state: it loads that [BV, K] tile once
into registers (16-byte loads along the contiguous K), runs every token of the step on it and
stores it once. Rows of the delta rule are independent (row v of S needs only v[v]), so the tiles
need nothing from each other; what they share is:
- q and k: every program recomputes the head's conv + SiLU + l2norm of q and k and the gate (a few
  KB of L1/L2 reads against the 2 * BV * K * 4 bytes of state it moves) instead of a second launch;
- the gated RMSNorm, which needs all V outputs of the head. With SPLIT == 1 the program has them.
  With SPLIT > 1 each program writes its fp32 o-tile (as int32 bits) into the head's workspace row,
  and one program of the head *finishes* it: reads the whole row, writes the normalized output,
  rewrites the q/k conv window and puts the row back to rest (all WS_SENTINEL). The finisher is
  picked by an arrival counter: after a CTA barrier (every thread's stores precede it) each
  program bumps the head's counter (acq_rel); the one that sees SPLIT-1 finishes and zeroes the
  counter. No program ever waits on another (waiting would need the hardware to dispatch a grid
  in order, which nothing guarantees), at the price of a fence and an atomic round trip each.
- the conv window of the head's q and k channels: all SPLIT programs read it, so only the finisher
  rewrites it, after it knows every sibling is done (their reads precede their release). Each
  program rewrites its own v channels' window.

Why one pass over the state suffices: with S' = S * exp(gk) (decay along K),
    u = beta * (v - S' k),   S'' = S' + u k^T,   o = S'' q = S' q + u (k . q),
so S' k and S' q are two reductions of the same loaded rows, and k . q is a scalar per token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.triton_math import l2_normalize, log_decay, rms_rstd


@triton.jit
def _silu_conv4(w0, w1, w2, w3, h0, h1, h2, x):
    """y = silu(w0 h0 + w1 h1 + w2 h2 + w3 x): the width-4 conv of one token, oldest row first."""
    y = w0 * h0 + w1 * h1 + w2 * h2 + w3 * x
    return y * tl.sigmoid(y)


@triton.jit
def _taps(w_ptr, P: tl.constexpr):
    """The 4 taps of the [3, W, P] conv weight for one group: contiguous along channels."""
    return tl.load(w_ptr), tl.load(w_ptr + P), tl.load(w_ptr + 2 * P), tl.load(w_ptr + 3 * P)


@triton.jit
def _window(row_ptr, stride_row, mask):
    """The 3 history rows (oldest first) that precede the step's first token, in fp32."""
    h0 = tl.load(row_ptr, mask=mask, other=0.0).to(tl.float32)
    h1 = tl.load(row_ptr + stride_row, mask=mask, other=0.0).to(tl.float32)
    h2 = tl.load(row_ptr + 2 * stride_row, mask=mask, other=0.0).to(tl.float32)
    return h0, h1, h2


@triton.jit
def _log_decay(forget_ptr, dt_bias_ptr, a_log, lower_bound, BOUNDED_GATE: tl.constexpr, GATE_DT: tl.constexpr):
    """gk = LB * sigmoid(exp(A_log) (forget_logits + dt_bias)) (bounded) or -exp(A_log) softplus(forget_logits + dt_bias);
    rounded to GATE_DT (Ling-3, KDAWeights.gate_dtype; fp32: no rounding)."""
    x = tl.load(forget_ptr).to(tl.float32) + tl.load(dt_bias_ptr).to(tl.float32)
    gk = log_decay(x, tl.exp(a_log), lower_bound, BOUNDED_GATE)
    gk = gk.to(GATE_DT).to(tl.float32)   # Ling-3's rounding (KDAWeights.gate_dtype); fp32: none
    return gk


WS_SENTINEL: tl.constexpr = tl.constexpr(0x7FA5A5A5)  # a signalling-NaN payload: no fp32 result has it


@triton.jit
def _ws_read(ptr):
    """A workspace row written by other programs: .cg reads from L2, never from this SM's L1."""
    return tl.load(ptr, cache_modifier=".cg")


@triton.jit
def _gated_norm_store(o, gate_w, out_ptr, mask, norm_eps, D: tl.constexpr):
    """out = o * rsqrt(mean(o^2) + eps) * (w * sigmoid(output_gate_logits)) over the head's D outputs."""
    rstd = rms_rstd(tl.sum(o * o, 0), norm_eps, D)
    tl.store(out_ptr, (o * rstd * gate_w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_w(out_gate_ptr, w_norm):
    return tl.sigmoid(tl.load(out_gate_ptr).to(tl.float32)) * w_norm


@triton.jit
def _conv_row_src(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, ch, mask, i_n, offset, i,
                  TOKENS: tl.constexpr):
    """Row i of history[: offset+3] ++ the step's tokens, for channels `ch`, in fp32."""
    from_hist = i < offset + 3
    t_src = (i_n * TOKENS + (i - offset - 3)).to(tl.int64)
    h = tl.load(cs_slot + i * stride_cs_row + ch * stride_cs_chan, mask=mask & from_hist, other=0.0)
    x = tl.load(qkv + t_src * stride_qkv_t + ch, mask=mask & (~from_hist), other=0.0)
    return tl.where(from_hist, h.to(tl.float32), x.to(tl.float32))


@triton.jit
def _rewrite_conv(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, ch, mask, i_n, offset,
                  h0, h1, h2, L: tl.constexpr, TOKENS: tl.constexpr, FROM_REGS: tl.constexpr):
    """The slot's new rows for channels `ch`: the last L rows of history[: offset+3] ++ the step's
    tokens. The newest 3 are the final window (h0, h1, h2): stored from registers when FROM_REGS
    (fewest round trips: latency-bound launch shapes), else re-read from the slot and qkv (L1/L2
    hits; frees the window's registers for occupancy). Older rows (a pool sized for drafts) are
    re-read. A barrier precedes each store, so every thread of the program has read every row it
    needs (windows earlier, shift sources here) before any is overwritten (threads of a program can
    hold the same element, so program order alone is not enough)."""
    kept0 = offset + 3 + TOKENS - L  # first surviving row of history ++ tokens
    dt = cs_slot.dtype.element_ty
    if FROM_REGS or L > 3:
        for rr in tl.static_range(L - 3):
            val = _conv_row_src(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, ch, mask, i_n, offset,
                                kept0 + rr, TOKENS)
            tl.debug_barrier()
            tl.store(cs_slot + rr * stride_cs_row + ch * stride_cs_chan, val.to(dt), mask=mask)
    if not FROM_REGS:
        h0 = _conv_row_src(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, ch, mask, i_n, offset,
                           kept0 + L - 3, TOKENS)
        h1 = _conv_row_src(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, ch, mask, i_n, offset,
                           kept0 + L - 2, TOKENS)
        h2 = _conv_row_src(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, ch, mask, i_n, offset,
                           kept0 + L - 1, TOKENS)
    tl.debug_barrier()
    new = cs_slot + (L - 3) * stride_cs_row + ch * stride_cs_chan
    tl.store(new, h0.to(dt), mask=mask)
    tl.store(new + stride_cs_row, h1.to(dt), mask=mask)
    tl.store(new + 2 * stride_cs_row, h2.to(dt), mask=mask)


@triton.jit
def kda_fused_decode_kernel(
    qkv, forget_logits, beta_logits, output_gate_logits, conv_w, A_log, dt_bias, norm_w,
    conv_state, state, state_indices, spec_indices, num_accepted, out, ws_o, ws_count,
    stride_qkv_t, stride_forget_t, stride_forget_h, stride_b_t, stride_b_h, stride_out_gate_t, stride_out_gate_h,
    stride_cs_slot, stride_cs_row, stride_cs_chan,
    stride_s_slot, stride_s_h, stride_s_v,
    stride_spec_n, stride_spec_t, stride_o_t, stride_o_h,
    lower_bound, norm_eps,
    H: tl.constexpr, D: tl.constexpr, L: tl.constexpr, TOKENS: tl.constexpr, SCALE: tl.constexpr,
    IS_SPEC: tl.constexpr, BOUNDED_GATE: tl.constexpr, BV: tl.constexpr,
    WIN_REGS: tl.constexpr, STORE_FIRST: tl.constexpr, GATE_DT: tl.constexpr = tl.float32,
):
    """WIN_REGS: the conv rows are rewritten from the window registers (no reload, for
    latency-bound shapes) instead of re-read from L1/L2 (frees registers for occupancy).
    STORE_FIRST: with SPLIT > 1, the state tile is stored before the arrival (the release then
    waits for it) instead of after it."""
    P: tl.constexpr = H * D
    SPLIT: tl.constexpr = D // BV
    pid = tl.program_id(0)
    i_v = pid % SPLIT  # V-slices of one head are neighbours: they share q/k reads in L2
    head = pid // SPLIT  # = i_n * H + i_h: the head's workspace row and counter
    i_n = head // H
    i_h = head % H
    d = tl.arange(0, D)
    c = i_h * D + d  # the head's channels within each of the q, k, v groups
    rv = i_v * BV + tl.arange(0, BV)  # this program's V rows
    cv = 2 * P + i_h * D + rv  # ... and their v channels

    # Loads that do not depend on the slot first, so they are in flight while the slot arrives
    # (hence masks, not an early return, for padding rows).
    wq0, wq1, wq2, wq3 = _taps(conv_w + c, P)
    wk0, wk1, wk2, wk3 = _taps(conv_w + 4 * P + c, P)
    wv0, wv1, wv2, wv3 = _taps(conv_w + 8 * P + i_h * D + rv, P)
    a_log = tl.load(A_log + i_h).to(tl.float32)
    w_norm = tl.load(norm_w + d).to(tl.float32)
    if TOKENS == 1:
        gate_w = _gate_w(output_gate_logits + i_n * stride_out_gate_t + i_h * stride_out_gate_h + d, w_norm)

    # Slots. The conv window lives in state_indices[n]; the recurrence reads state_indices[n], or
    # when verifying spec_state_indices[n, accepted-1]. Index <= 0 = padding (CUDA-graph rows):
    # nothing is read or written. Every condition depends on n only: a head's programs agree.
    conv_slot = tl.load(state_indices + i_n).to(tl.int64)
    conv_on = conv_slot > 0
    if IS_SPEC:
        spec_row = spec_indices + i_n * stride_spec_n
        rec_on = tl.load(spec_row) > 0
        # Clamped only to keep addresses inside the row; the reference rejects values outside [1, S+1].
        accepted = tl.minimum(tl.maximum(tl.load(num_accepted + i_n).to(tl.int32), 1), TOKENS)
        read_slot = tl.load(spec_row + (accepted - 1) * stride_spec_t).to(tl.int64)
        offset = accepted - 1  # history rows after the accepted drafts of the previous verify
    else:
        rec_on = conv_on
        read_slot = conv_slot
        offset = L - 3  # the newest W-1 rows

    cs_slot = conv_state + tl.maximum(conv_slot, 0) * stride_cs_slot
    win = cs_slot + offset * stride_cs_row
    s_head = state + i_h * stride_s_h  # + slot * stride_s_slot
    # [BV, K], K contiguous: 16-byte loads along K
    s_tile = rv[:, None] * stride_s_v + d[None, :]
    S = tl.load(s_head + read_slot * stride_s_slot + s_tile, mask=rec_on, other=0.0).to(tl.float32)
    hq0, hq1, hq2 = _window(win + c * stride_cs_chan, stride_cs_row, conv_on)
    hk0, hk1, hk2 = _window(win + (P + c) * stride_cs_chan, stride_cs_row, conv_on)
    hv0, hv1, hv2 = _window(win + cv * stride_cs_chan, stride_cs_row, conv_on)

    for j in tl.static_range(TOKENS):
        t = i_n * TOKENS + j
        x_row = qkv + t.to(tl.int64) * stride_qkv_t
        xq = tl.load(x_row + c, mask=conv_on, other=0.0).to(tl.float32)
        xk = tl.load(x_row + P + c, mask=conv_on, other=0.0).to(tl.float32)
        xv = tl.load(x_row + cv, mask=conv_on, other=0.0).to(tl.float32)
        gk = _log_decay(forget_logits + t * stride_forget_t + i_h * stride_forget_h + d, dt_bias + i_h * D + d, a_log,
                        lower_bound, BOUNDED_GATE, GATE_DT)
        beta = tl.sigmoid(tl.load(beta_logits + t * stride_b_t + i_h * stride_b_h).to(tl.float32))
        q = l2_normalize(_silu_conv4(wq0, wq1, wq2, wq3, hq0, hq1, hq2, xq), SCALE)
        k = l2_normalize(_silu_conv4(wk0, wk1, wk2, wk3, hk0, hk1, hk2, xk), 1.0)
        v = _silu_conv4(wv0, wv1, wv2, wv3, hv0, hv1, hv2, xv)
        hq0, hq1, hq2 = hq1, hq2, xq  # slide the windows (registers only)
        hk0, hk1, hk2 = hk1, hk2, xk
        hv0, hv1, hv2 = hv1, hv2, xv

        S = S * tl.exp(gk)[None, :]
        Sk = tl.sum(S * k[None, :], 1)
        Sq = tl.sum(S * q[None, :], 1)
        u = beta * (v - Sk)
        S = S + u[:, None] * k[None, :]
        o = Sq + u * tl.sum(k * q, 0)  # = S'' q, without a second pass over the state
        if IS_SPEC:
            dst = tl.load(spec_row + j * stride_spec_t).to(tl.int64)
            tl.store(s_head + dst * stride_s_slot + s_tile, S.to(state.dtype.element_ty), mask=rec_on & (dst > 0))
        if SPLIT == 1:
            if TOKENS > 1:
                gate_w = _gate_w(output_gate_logits + t * stride_out_gate_t + i_h * stride_out_gate_h + d, w_norm)
            _gated_norm_store(o, gate_w, out + t * stride_o_t + i_h * stride_o_h + d, rec_on, norm_eps, D)
        else:
            # As int32 bits: the at-rest sentinel is a NaN payload that arithmetic never produces.
            tl.store(ws_o + (head.to(tl.int64) * TOKENS + j) * D + rv, o.to(tl.int32, bitcast=True),
                     mask=conv_on | rec_on)

    active = conv_on | rec_on
    ws_row = ws_o + head.to(tl.int64) * TOKENS * D
    if (STORE_FIRST or SPLIT == 1) and not IS_SPEC:  # (verify stored per token above)
        tl.store(s_head + read_slot * stride_s_slot + s_tile, S.to(state.dtype.element_ty), mask=rec_on)
    if SPLIT > 1:
        # Arrive: every thread's workspace stores (and window reads) precede thread 0's release.
        tl.debug_barrier()
        arrived = tl.atomic_add(ws_count + head, 1, sem="acq_rel", scope="gpu", mask=active)
        if not STORE_FIRST and not IS_SPEC:
            tl.store(s_head + read_slot * stride_s_slot + s_tile, S.to(state.dtype.element_ty), mask=rec_on)

    # ---- conv state: this program's v channels; the q and k channels once nobody reads them ----
    _rewrite_conv(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, cv, conv_on, i_n, offset,
                  hv0, hv1, hv2, L, TOKENS, WIN_REGS)
    qk = tl.arange(0, 2)[:, None] * P + c[None, :]  # [2, D]: the head's q and k channels
    hqk0 = tl.where(qk < P, hq0[None, :], hk0[None, :])
    hqk1 = tl.where(qk < P, hq1[None, :], hk1[None, :])
    hqk2 = tl.where(qk < P, hq2[None, :], hk2[None, :])
    if SPLIT == 1:
        _rewrite_conv(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, qk, conv_on, i_n, offset,
                      hqk0, hqk1, hqk2, L, TOKENS, WIN_REGS)
    else:
        finisher = (arrived == SPLIT - 1) & active  # last to arrive: all o-tiles in, all windows read
        if finisher:
            if TOKENS == 1:  # in flight together with the conv rows the rewrite re-reads
                o_bits = _ws_read(ws_row + d)
            _rewrite_conv(cs_slot, stride_cs_row, stride_cs_chan, qkv, stride_qkv_t, qk, conv_on, i_n, offset,
                          hqk0, hqk1, hqk2, L, TOKENS, WIN_REGS)
            for j in tl.static_range(TOKENS):
                tn = i_n * TOKENS + j
                if TOKENS > 1:
                    gate_w = _gate_w(output_gate_logits + tn * stride_out_gate_t + i_h * stride_out_gate_h + d, w_norm)
                    o_bits = _ws_read(ws_row + j * D + d)
                _gated_norm_store(o_bits.to(tl.float32, bitcast=True), gate_w,
                                  out + tn * stride_o_t + i_h * stride_o_h + d, rec_on, norm_eps, D)
            # Back to rest for the next launch: every thread has read the row (barrier), then the
            # row is refilled with the sentinel and the counter zeroed.
            tl.debug_barrier()
            for j in tl.static_range(TOKENS):
                tl.store(ws_row + j * D + d, tl.full([D], WS_SENTINEL, tl.int32))
            tl.store(ws_count + head, 0)
