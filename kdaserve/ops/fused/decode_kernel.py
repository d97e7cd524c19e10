"""The single-launch KDA decode kernel: conv update + SiLU, l2norm, gate, beta, delta rule on the
paged state, gated RMSNorm, all in one program per (sequence, head).

Why one program owns a whole head: the gated RMSNorm needs every V row of the head's output, and
the conv channels of a head (its q, k and v columns) are read and rewritten by nobody else, so no
program ever shifts a conv window that another program is still reading (the race of prior-art.md
section 4). Sequences x heads sit on grid axis x (axis z is capped at 65,535).

Why one pass over the state suffices: with S' = S * exp(gk) (decay along K),
    u = beta * (v - S' k),   S'' = S' + u k^T,   o = S'' q = S' q + u (k . q),
so S' k and S' q are two reductions of the same loaded rows, and k . q is a scalar per token.

Two state paths, chosen by the constexpr BV (V rows per block):
- BV == D: the whole [V, K] state sits in registers; any number of tokens per sequence
  (speculative verify: TOKENS = S+1, state stored after every token into its spec slot).
- BV < D: the state streams through in [BV, K] blocks, software-pipelined by `tl.range`; one token
  per sequence. Rows of the delta rule are independent, so each block is final once visited; the
  block outputs are gathered into a [D/BV, BV] tile for the norm.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _softplus(x):
    """torch's softplus, linear above 20. For x << 0, log(1 + exp(x)) loses exp(x)'s low digits,
    but so does exp(gk) ~ 1 - tiny in fp32: the decay is unaffected."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _log_decay(g1_ptr, dt_bias_ptr, a_log, lower_bound, BOUNDED_GATE: tl.constexpr):
    """gk = LB * sigmoid(exp(A_log) (g1 + dt_bias)) (bounded) or -exp(A_log) softplus(g1 + dt_bias)."""
    x = tl.load(g1_ptr).to(tl.float32) + tl.load(dt_bias_ptr).to(tl.float32)
    a = tl.exp(a_log)
    if BOUNDED_GATE:
        gk = lower_bound * tl.sigmoid(a * x)
    else:
        gk = -a * _softplus(x)
    return gk


@triton.jit
def _l2norm(x, scale):
    return x * (tl.rsqrt(tl.sum(x * x, 0) + 1e-6) * scale)


@triton.jit
def kda_fused_decode_kernel(
    qkv, g1, beta_logits, g2, conv_w, A_log, dt_bias, norm_w,
    conv_state, state, state_indices, spec_indices, num_accepted, out,
    stride_qkv_t, stride_g1_t, stride_g1_h, stride_b_t, stride_b_h, stride_g2_t, stride_g2_h,
    stride_cs_slot, stride_cs_row, stride_cs_chan,
    stride_s_slot, stride_s_h, stride_s_v,
    stride_spec_n, stride_spec_t, stride_o_t, stride_o_h,
    lower_bound, norm_eps,
    H: tl.constexpr, D: tl.constexpr, L: tl.constexpr, TOKENS: tl.constexpr, SCALE: tl.constexpr,
    IS_SPEC: tl.constexpr, BOUNDED_GATE: tl.constexpr, BV: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    P: tl.constexpr = H * D
    pid = tl.program_id(0)
    i_n = pid // H
    i_h = pid % H

    # Slots. The conv window lives in state_indices[n]; the recurrence reads state_indices[n], or
    # when verifying spec_state_indices[n, accepted-1]. Index <= 0 = padding (CUDA-graph rows).
    conv_slot = tl.load(state_indices + i_n).to(tl.int64)
    conv_on = conv_slot > 0
    if IS_SPEC:
        spec_row = spec_indices + i_n * stride_spec_n
        rec_on = tl.load(spec_row) > 0
        # Clamped only to keep addresses inside the row; the reference rejects values outside [1, S+1].
        accepted = tl.minimum(tl.maximum(tl.load(num_accepted + i_n).to(tl.int32), 1), TOKENS)
        read_slot = tl.load(spec_row + (accepted - 1) * stride_spec_t).to(tl.int64)
        offset = accepted - 1  # history rows after the accepted drafts of the previous verify
        if (conv_slot <= 0) & (~rec_on):
            return
    else:
        rec_on = conv_on
        read_slot = conv_slot
        offset = L - 3  # the newest W-1 rows
        if conv_slot <= 0:
            return

    d = tl.arange(0, D)
    c = i_h * D + d  # this head's channels within each of the q, k, v groups
    cs_slot = conv_state + conv_slot * stride_cs_slot
    win = cs_slot + offset * stride_cs_row
    a_log = tl.load(A_log + i_h).to(tl.float32)
    s_head = state + i_h * stride_s_h  # + slot * stride_s_slot

    wq0, wq1, wq2, wq3 = _taps(conv_w + c, P)
    wk0, wk1, wk2, wk3 = _taps(conv_w + 4 * P + c, P)
    hq0, hq1, hq2 = _window(win + c * stride_cs_chan, stride_cs_row, conv_on)
    hk0, hk1, hk2 = _window(win + (P + c) * stride_cs_chan, stride_cs_row, conv_on)
    w_norm = tl.load(norm_w + d).to(tl.float32)

    if BV == D:
        # ---- whole state in registers; TOKENS >= 1 ----
        wv0, wv1, wv2, wv3 = _taps(conv_w + 8 * P + c, P)
        hv0, hv1, hv2 = _window(win + (2 * P + c) * stride_cs_chan, stride_cs_row, conv_on)
        s_tile = d[:, None] * stride_s_v + d[None, :]  # [V, K], K contiguous: 16-byte loads along K
        S = tl.load(s_head + read_slot * stride_s_slot + s_tile, mask=rec_on, other=0.0).to(tl.float32)
        for j in tl.static_range(TOKENS):
            t = i_n * TOKENS + j
            x_row = qkv + t.to(tl.int64) * stride_qkv_t
            xq = tl.load(x_row + c, mask=conv_on, other=0.0).to(tl.float32)
            xk = tl.load(x_row + P + c, mask=conv_on, other=0.0).to(tl.float32)
            xv = tl.load(x_row + 2 * P + c, mask=conv_on, other=0.0).to(tl.float32)
            q = _l2norm(_silu_conv4(wq0, wq1, wq2, wq3, hq0, hq1, hq2, xq), SCALE)
            k = _l2norm(_silu_conv4(wk0, wk1, wk2, wk3, hk0, hk1, hk2, xk), 1.0)
            v = _silu_conv4(wv0, wv1, wv2, wv3, hv0, hv1, hv2, xv)
            hq0, hq1, hq2 = hq1, hq2, xq  # slide the windows (registers only: nothing shared)
            hk0, hk1, hk2 = hk1, hk2, xk
            hv0, hv1, hv2 = hv1, hv2, xv
            gk = _log_decay(g1 + t * stride_g1_t + i_h * stride_g1_h + d, dt_bias + i_h * D + d, a_log,
                            lower_bound, BOUNDED_GATE)
            beta = tl.sigmoid(tl.load(beta_logits + t * stride_b_t + i_h * stride_b_h).to(tl.float32))

            S = S * tl.exp(gk)[None, :]
            Sk = tl.sum(S * k[None, :], 1)
            Sq = tl.sum(S * q[None, :], 1)
            u = beta * (v - Sk)
            S = S + u[:, None] * k[None, :]
            o = Sq + u * tl.sum(k * q, 0)  # = S'' q, without a second pass over the state
            if IS_SPEC:
                dst = tl.load(spec_row + j * stride_spec_t).to(tl.int64)
                tl.store(s_head + dst * stride_s_slot + s_tile, S.to(state.dtype.element_ty),
                         mask=rec_on & (dst > 0))

            rstd = tl.rsqrt(tl.sum(o * o, 0) / D + norm_eps)
            gate = tl.sigmoid(tl.load(g2 + t * stride_g2_t + i_h * stride_g2_h + d).to(tl.float32))
            y = o * rstd * w_norm * gate
            tl.store(out + t * stride_o_t + i_h * stride_o_h + d, y.to(out.dtype.element_ty), mask=rec_on & (d < D))
        if not IS_SPEC:
            tl.store(s_head + read_slot * stride_s_slot + s_tile, S.to(state.dtype.element_ty), mask=rec_on)
    else:
        # ---- state streamed in [BV, K] blocks; one token per sequence ----
        t = i_n
        x_row = qkv + t.to(tl.int64) * stride_qkv_t
        xq = tl.load(x_row + c).to(tl.float32)
        xk = tl.load(x_row + P + c).to(tl.float32)
        q = _l2norm(_silu_conv4(wq0, wq1, wq2, wq3, hq0, hq1, hq2, xq), SCALE)
        k = _l2norm(_silu_conv4(wk0, wk1, wk2, wk3, hk0, hk1, hk2, xk), 1.0)
        gk = _log_decay(g1 + t * stride_g1_t + i_h * stride_g1_h + d, dt_bias + i_h * D + d, a_log,
                        lower_bound, BOUNDED_GATE)
        decay = tl.exp(gk)
        beta = tl.sigmoid(tl.load(beta_logits + t * stride_b_t + i_h * stride_b_h).to(tl.float32))
        kq = tl.sum(k * q, 0)

        NV: tl.constexpr = D // BV
        blk = tl.arange(0, NV)
        r = tl.arange(0, BV)
        s_rows = s_head + read_slot * stride_s_slot
        o_tile = tl.zeros([NV, BV], dtype=tl.float32)
        for iv in tl.range(0, NV, num_stages=NUM_STAGES):
            rows = iv * BV + r
            vc = 2 * P + i_h * D + rows  # this block's v channels
            wv0, wv1, wv2, wv3 = _taps(conv_w + 8 * P + i_h * D + rows, P)
            hv0, hv1, hv2 = _window(win + vc * stride_cs_chan, stride_cs_row, conv_on)
            v = _silu_conv4(wv0, wv1, wv2, wv3, hv0, hv1, hv2, tl.load(x_row + vc).to(tl.float32))
            p_s = s_rows + rows[:, None] * stride_s_v + d[None, :]
            S = tl.load(p_s).to(tl.float32) * decay[None, :]
            Sk = tl.sum(S * k[None, :], 1)
            Sq = tl.sum(S * q[None, :], 1)
            u = beta * (v - Sk)
            tl.store(p_s, (S + u[:, None] * k[None, :]).to(state.dtype.element_ty))
            o_tile = tl.where(blk[:, None] == iv, (Sq + u * kq)[None, :], o_tile)
        o_cols = blk[:, None] * BV + r[None, :]  # [NV, BV] -> V index
        rstd = tl.rsqrt(tl.sum(tl.sum(o_tile * o_tile, 1), 0) / D + norm_eps)
        gate = tl.sigmoid(tl.load(g2 + t * stride_g2_t + i_h * stride_g2_h + o_cols).to(tl.float32))
        y = o_tile * rstd * tl.load(norm_w + o_cols).to(tl.float32) * gate
        tl.store(out + t * stride_o_t + i_h * stride_o_h + o_cols, y.to(out.dtype.element_ty))

    # ---- conv state: the last L rows of (history[: offset+3] ++ the step's tokens) ----
    # Rewritten last, each row after a barrier, so every thread has read all the rows it needs
    # (windows above, shift sources here) before any row of this head's channels is overwritten.
    grp = tl.arange(0, 4)[:, None]  # q, k, v (+1 padding row: arange needs a power of two)
    ch = grp * P + c[None, :]
    gmask = (grp < 3) & conv_on
    kept0 = offset + 3 + TOKENS - L  # first surviving row of history ++ tokens
    for rr in tl.static_range(L):
        i = kept0 + rr
        from_hist = i < offset + 3
        from_x = i >= offset + 3
        t_src = (i_n * TOKENS + (i - offset - 3)).to(tl.int64)
        h = tl.load(cs_slot + i * stride_cs_row + ch * stride_cs_chan, mask=gmask & from_hist, other=0.0)
        x = tl.load(qkv + t_src * stride_qkv_t + ch, mask=gmask & from_x, other=0.0)
        val = tl.where(from_hist, h.to(tl.float32), x.to(tl.float32))
        tl.debug_barrier()
        tl.store(cs_slot + rr * stride_cs_row + ch * stride_cs_chan, val.to(conv_state.dtype.element_ty), mask=gmask)
