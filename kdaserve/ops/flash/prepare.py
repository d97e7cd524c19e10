"""K1, the token-parallel prepare pass: one program per (chunk, head), no serial dependence.

From the pre-conv q|k|v rows of one C-token chunk it computes, all in fp32 registers:
conv + SiLU (history from the conv-state pool), l2norm (scale folded into q), the forget gate and
its in-chunk cumsum g, beta; then the chunk's WY factors (see reference/chunked.py):

    A[t,i]   = beta_t sum_c k_t k_i e^(g_t - g_i)   (i < t)      Aqk[t,i] = sum_c q_t k_i e^(g_t - g_i)   (i <= t)
    T        = (I + A)^-1                                        W  = T diag(beta) (K * e^g)
    U~       = T diag(beta) V                                    Qg = Q * e^g,   Kd = K * e^(g_C - g),   gam = e^(g_C)

and writes W, U~, Qg, Kd, Aqk (workspace dtype: fp16 for 16-bit inputs) and gam (fp32): all the
recurrence needs, ~1 KB per token-head. The numerics of each step are argued in
docs/flash-prefill.md; in short:
- A and Aqk come from one tensor-core dot each: e^(g_t - g_i) = e^(g_t - a) e^(a - g_i) with the
  anchor a = g_C / 2 in the middle of the chunk, so every factor stays within e^(+-80) for 32
  tokens at LB = -5 (e^(+-40) for 16): fp32/tf32 range, which fp16 could not hold. The unbounded
  gate has no such bound: the same one-anchor pass flags the chunks whose decay exceeds it, and a
  third launch redoes those, anchoring each half of the 16-token chunk apart
  (_intra_anchored_halves) where the halves' spread allows, else by the blocked fallback
  (_intra_blocked, any decay) or the exact column loop (_intra_exact).
- T by recursive blocking: T_2b = T_b - T_b A_off T_b doubles the solved diagonal blocks; every
  product is of bounded entries of the final inverse, unlike a Neumann/doubling product whose
  powers of A grow when decay is slow. The dots are tf32 like the others (tf32x3 would cost 14%
  more instructions in this instruction-bound kernel for accuracy the fp16 workspace drops anyway).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.flash.fastmath import fast_exp, fast_rcp, fast_sigmoid, sigmoid_tanh
from kdaserve.ops.tri_inverse import unit_lower_inverse
from kdaserve.ops.triton_math import softplus


@triton.jit
def _exp_accurate(x):
    """e^x for the chunk decay, which compounds over every chunk of a sequence: a degree-5 Taylor
    polynomial near 0 (slow-decay heads, |x| < 1/16: error < 1e-10 where ex2.approx errs ~2e-7
    and 8K chunks of bias would add up), ex2 elsewhere (such decays forget within ~16/|x| chunks)."""
    p = 1.0 + x * (1.0 + x * 0.5 * (1.0 + x * (1.0 / 3.0) * (1.0 + x * 0.25 * (1.0 + x * 0.2))))
    return tl.where(tl.abs(x) < 0.0625, p, tl.exp(x))


@triton.jit
def _conv_silu(
    x_ptr, stride_x, w_ptr, stride_w_c, stride_w_j, hist_ptr, stride_h_row, stride_h_ch,
    ch, tok, valid, seq_start, init, L, W: tl.constexpr, FAST: tl.constexpr,
):
    """silu(sum_j w[c, j] x[t - (W-1) + j, c]) for a [C, D] tile; rows before the sequence's start
    come from the history (conv-state rows L-(W-1) .. L-1) when it has one, else are zero."""
    acc = tl.zeros([tok.shape[0], ch.shape[0]], dtype=tl.float32)
    for jj in tl.static_range(W):
        r = tok - (W - 1) + jj
        in_seq = r >= seq_start
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + ch[None, :],
                    mask=(valid & in_seq)[:, None], other=0.0).to(tl.float32)
        hrow = L + (r - seq_start)
        hx = tl.load(hist_ptr + hrow[:, None] * stride_h_row + ch[None, :] * stride_h_ch,
                     mask=(valid & (r < seq_start) & init)[:, None], other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + ch * stride_w_c + jj * stride_w_j).to(tl.float32)
        acc += (x + hx) * wj[None, :]
    return acc * sigmoid_tanh(acc, FAST)


@triton.jit
def _conv_silu_no_history(x_ptr, stride_x, w_ptr, stride_w_c, stride_w_j, ch, tok, valid, W: tl.constexpr,
                          FAST: tl.constexpr):
    """_conv_silu for a chunk whose window lies inside the new tokens (every chunk but a
    sequence's first): no history loads, no selects."""
    acc = tl.zeros([tok.shape[0], ch.shape[0]], dtype=tl.float32)
    for jj in tl.static_range(W):
        r = tok - (W - 1) + jj
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + ch[None, :], mask=valid[:, None], other=0.0)
        wj = tl.load(w_ptr + ch * stride_w_c + jj * stride_w_j).to(tl.float32)
        acc += x.to(tl.float32) * wj[None, :]
    return acc * sigmoid_tanh(acc, FAST)


@triton.jit
def _intra_exact(q, k, g, rows, C: tl.constexpr, FAST: tl.constexpr):
    """A_kk[t,i] = sum_c k_t k_i e^(g_t - g_i), A_qk likewise, column by column with the exact
    exponent (any decay, no anchor); zero above the diagonal."""
    cols = rows[None, :]
    akk = tl.zeros([C, C], dtype=tl.float32)
    aqk = tl.zeros([C, C], dtype=tl.float32)
    for i in tl.static_range(C):
        sel = rows[:, None] == i
        k_i = tl.sum(tl.where(sel, k, 0.0), axis=0)
        g_i = tl.sum(tl.where(sel, g, 0.0), axis=0)
        e = fast_exp(tl.where(rows[:, None] >= i, g - g_i[None, :], -float("inf")), FAST)
        kk = k_i[None, :] * e
        akk = tl.where(cols == i, tl.sum(k * kk, axis=1)[:, None], akk)
        aqk = tl.where(cols == i, tl.sum(q * kk, axis=1)[:, None], aqk)
    return akk, aqk


@triton.jit
def _intra_blocked(q, k, g, rows, C: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr):
    """A_kk and A_qk of _intra_exact for any decay, in blocks of B = 4 rows: a pair (t, i) with i
    in an earlier block than t factors around g at the first row a of t's block, where both
    factors e^(g_t - g_a) and e^(g_a - g_i) are <= 1 (an underflow means a true product below
    fp32's range anyway): one tensor-core dot per block and matrix. Pairs inside a block take the
    exact exponent, B columns at a time (tl.gather brings each row's j-th block column to it).
    Factors of pairs a dot does not own are selected to zero before they are multiplied, so none
    can overflow; entries above the diagonal are garbage the caller discards."""
    B: tl.constexpr = 4
    blk = rows // B
    cols = rows[None, :]
    akk = tl.zeros([C, C], dtype=tl.float32)
    aqk = tl.zeros([C, C], dtype=tl.float32)
    for r in tl.static_range(1, C // B):
        g_a = tl.sum(tl.where(rows[:, None] == r * B, g, 0.0), axis=0)
        mine = (blk == r)[:, None]
        e_l = tl.where(mine, fast_exp(tl.where(mine, g - g_a[None, :], 0.0), FAST), 0.0)
        before = (rows < r * B)[:, None]
        kr = tl.trans(k * tl.where(before, fast_exp(tl.where(before, g_a[None, :] - g, 0.0), FAST), 0.0))
        akk += tl.dot(k * e_l, kr, input_precision=PREC)
        aqk += tl.dot(q * e_l, kr, input_precision=PREC)
    for j in tl.static_range(B):
        col = blk * B + j                                    # [C]: each row's j-th column of its block
        idx = tl.broadcast_to(col[:, None], (C, k.shape[1]))
        k_j = tl.gather(k, idx, axis=0)
        e = fast_exp(tl.where((rows >= col)[:, None], g - tl.gather(g, idx, axis=0), -float("inf")), FAST)
        kk = k_j * e
        here = cols == col[:, None]
        akk = tl.where(here, tl.sum(k * kk, axis=1)[:, None], akk)
        aqk = tl.where(here, tl.sum(q * kk, axis=1)[:, None], aqk)
    return akk, aqk


@triton.jit
def _intra_anchored_halves(q, k, g, g_m, g_c, rows, C: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr):
    """A_kk and A_qk of _intra_exact on tensor cores, for a chunk whose two halves each span a
    cumulative log-decay of at most FlashConfig.unbounded_anchor_spread (the caller checks). Three
    factorizations of e^(g_t - g_i), each exact where it is used (h = C/2; g_m, g_c = g at rows h-1,
    the halves' border, and C-1):
    - same half: anchor a = the half's mid-point of g (g_m / 2, or (g_m + g_c) / 2): factors
      e^(g_t - a) and e^(a - g_i) lie within e^(+-spread/2), fp32/tf32 range;
    - row in the second half, column in the first: anchor g_m, both factors e^(-|g - g_m|) <= 1
      (any decay: an underflow means a true product below fp32's range anyway).
    Entries of the other pairings (and above the diagonal) may be garbage or inf: the caller
    selects, never multiplies, them away."""
    H2: tl.constexpr = C // 2
    second = rows >= H2
    a = tl.where(second[:, None], (0.5 * (g_m + g_c))[None, :], (0.5 * g_m)[None, :])
    e_up = fast_exp(g - a, FAST)
    r_up = fast_rcp(e_up, FAST)
    e_x = fast_exp(-tl.abs(g - g_m[None, :]), FAST)
    kb = tl.trans(k * r_up)
    kx = k * e_x
    same = second[:, None] == second[None, :]
    akk = tl.where(same, tl.dot(k * e_up, kb, input_precision=PREC), tl.dot(kx, tl.trans(kx), input_precision=PREC))
    aqk = tl.where(same, tl.dot(q * e_up, kb, input_precision=PREC), tl.dot(q * e_x, tl.trans(kx), input_precision=PREC))
    return akk, aqk


@triton.jit
def _conv(x_ptr, stride_x, w_ptr, stride_w_c, stride_w_j, hist_ptr, stride_h_row, stride_h_ch,
          ch, tok, valid, seq_start, init, L, W: tl.constexpr, FAST: tl.constexpr, HIST: tl.constexpr):
    if HIST:
        return _conv_silu(x_ptr, stride_x, w_ptr, stride_w_c, stride_w_j, hist_ptr, stride_h_row, stride_h_ch,
                          ch, tok, valid, seq_start, init, L, W, FAST)
    else:
        return _conv_silu_no_history(x_ptr, stride_x, w_ptr, stride_w_c, stride_w_j, ch, tok, valid, W, FAST)


@triton.jit
def _gate_beta(forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h, a_log_ptr, dt_bias_ptr,
               lower_bound, h, tok, valid, rows, cols, D: tl.constexpr, C: tl.constexpr, BOUNDED: tl.constexpr,
               FAST: tl.constexpr):
    """The in-chunk cumulative log-decay g [C, D], its last row g_C and beta [C] (0 past the end)."""
    x = tl.load(forget_ptr + tok.to(tl.int64)[:, None] * stride_forget_t + h * stride_forget_h + cols[None, :] * stride_forget_d,
                mask=valid[:, None], other=0.0).to(tl.float32)
    x += tl.load(dt_bias_ptr + h * D + cols).to(tl.float32)[None, :]
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))  # one value: precise
    if BOUNDED:
        gk = lower_bound * fast_sigmoid(a * x, FAST)
    else:
        gk = -a * softplus(x)
    gk = tl.where(valid[:, None], gk, 0.0)
    g = tl.cumsum(gk, axis=0)
    g_last = tl.sum(tl.where(rows[:, None] == C - 1, g, 0.0), axis=0)
    bl = tl.load(b_ptr + tok.to(tl.int64) * stride_b_t + h * stride_b_h, mask=valid, other=0.0).to(tl.float32)
    beta = tl.where(valid, fast_sigmoid(bl, FAST), 0.0)
    return g, g_last, beta


@triton.jit
def _prepare_chunk(
    qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h,
    cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, flag_ptr, lower_bound, q_scale, L, anchor_spread,
    h, blk, tok, valid, seq_start, init,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOG2C: tl.constexpr, W: tl.constexpr,
    PREC_TC: tl.constexpr, FAST: tl.constexpr, HIST: tl.constexpr, BOUNDED: tl.constexpr,
):
    """One chunk of one head, one anchor: the bounded gate (|g| <= 5 C, always in range), or the
    unbounded gate's first pass, which flags chunks whose decay spread |g_C| exceeds
    `anchor_spread` in any channel (their W, U~ and Aqk may be garbage; the exact launch rewrites
    them before the recurrence reads them). HIST: the conv window reaches before the sequence's
    first token (its first chunk), so the conv reads history rows; without, a separate inlined copy
    carries none of that code or its registers.

    In the order that keeps the fewest [C, D] tiles live (K1 is occupancy-bound: registers decide
    how many programs share an SM; timings: docs/perf-notes.md, "Flash K1"): the gate first, then k, q and v each
    convolved when first needed and dropped after their last use, Kd and Qg stored at once.
    Two exponentials per element: e_up = e^(g - a) in e^(+-40) (C = 16) or e^(+-80) (C = 32), its
    reciprocal, and e^a per channel give every factor without overflow."""
    rows = tl.arange(0, C)
    cols = tl.arange(0, D)
    ri = rows[:, None]
    ci = rows[None, :]
    P = H * D
    tile = blk * (C * D) + ri * D + cols[None, :]
    dt = w_ptr.dtype.element_ty
    g, g_last, beta = _gate_beta(forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h,
                                 a_log_ptr, dt_bias_ptr, lower_bound, h, tok, valid, rows, cols, D, C, BOUNDED, FAST)
    if not BOUNDED:
        tl.store(flag_ptr + blk, (tl.max(-g_last, axis=0) > anchor_spread).to(tl.int8))
    anchor = 0.5 * g_last
    ea = fast_exp(anchor, FAST)[None, :]
    e_up = fast_exp(g - anchor[None, :], FAST)
    r_up = fast_rcp(e_up, FAST)
    k = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              P + h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    kb = k * r_up                   # k e^(a - g)
    ke = k * e_up                   # k e^(g - a)
    tl.store(kd_ptr + tile, (kb * ea).to(dt))   # Kd = k e^(g_C - g) = k e^a e^(a - g), as g_C = 2a
    akk = tl.dot(ke, tl.trans(kb), input_precision=PREC_TC)
    q = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    qe = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * q_scale)[:, None] * e_up
    aqk = tl.dot(qe, tl.trans(kb), input_precision=PREC_TC)
    tl.store(qg_ptr + tile, (qe * ea).to(dt))   # Qg = q e^g
    kbeta = (beta[:, None] * ke) * ea           # beta k e^g
    A = tl.where(ri > ci, beta[:, None] * akk, 0.0)
    tl.store(aqk_ptr + blk * (C * C) + ri * C + ci, tl.where(ri >= ci, aqk, 0.0).to(dt))
    Tinv = unit_lower_inverse(A, C, LOG2C, PREC_TC)
    tl.store(w_ptr + tile, tl.dot(Tinv, kbeta, input_precision=PREC_TC).to(dt))
    v = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              2 * P + h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    tl.store(u_ptr + tile, tl.dot(Tinv, beta[:, None] * v, input_precision=PREC_TC).to(dt))
    tl.store(gam_ptr + blk * D + cols, _exp_accurate(g_last))


@triton.jit
def _prepare_chunk_unbounded_halves(
    qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h,
    cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, flag_ptr, q_scale, L, anchor_spread,
    h, blk, tok, valid, seq_start, init,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOG2C: tl.constexpr, W: tl.constexpr,
    PREC_TC: tl.constexpr, FAST: tl.constexpr, HIST: tl.constexpr,
):
    """One chunk of one head, unbounded gate, A and Aqk always by the anchored halves
    (_intra_anchored_halves); straight-line code like the bounded path's, in its order (k, q, v
    convolved when first needed, outputs stored as soon as they exist). A chunk whose halves'
    decay spread exceeds `anchor_spread` in any channel may get garbage in W, U~ and Aqk: it sets
    its flag, and the exact launch (_prepare_chunk_unbounded) rewrites the chunk before the
    recurrence reads it. The exact loop is not compiled in here: it cost registers and spills
    in every chunk, though few chunks take it."""
    rows = tl.arange(0, C)
    cols = tl.arange(0, D)
    ri = rows[:, None]
    ci = rows[None, :]
    P = H * D
    tile = blk * (C * D) + ri * D + cols[None, :]
    dt = w_ptr.dtype.element_ty
    g, g_last, beta = _gate_beta(forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h,
                                 a_log_ptr, dt_bias_ptr, 0.0, h, tok, valid, rows, cols, D, C, False, FAST)
    g_m = tl.sum(tl.where(ri == C // 2 - 1, g, 0.0), axis=0)
    spread = tl.max(tl.maximum(-g_m, g_m - g_last), axis=0)
    tl.store(flag_ptr + blk, (spread > anchor_spread).to(tl.int8))
    second = ri >= C // 2
    same = second == (ci >= C // 2)
    a = tl.where(second, (0.5 * (g_m + g_last))[None, :], (0.5 * g_m)[None, :])
    k = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              P + h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    tl.store(kd_ptr + tile, (k * fast_exp(g_last[None, :] - g, FAST)).to(dt))   # Kd = k e^(g_C - g)
    e_up = fast_exp(g - a, FAST)
    kb = tl.trans(k * fast_rcp(e_up, FAST))      # k e^(a - g), as the dots' right operand
    kx = k * fast_exp(-tl.abs(g - g_m[None, :]), FAST)
    akk = tl.where(same, tl.dot(k * e_up, kb, input_precision=PREC_TC), tl.dot(kx, tl.trans(kx), input_precision=PREC_TC))
    kbeta = (beta[:, None] * k) * fast_exp(g, FAST)          # beta k e^g
    q = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * q_scale)[:, None]
    tl.store(qg_ptr + tile, (q * fast_exp(g, FAST)).to(dt))  # Qg = q e^g
    aqk = tl.where(same, tl.dot(q * e_up, kb, input_precision=PREC_TC),
                   tl.dot(q * fast_exp(-tl.abs(g - g_m[None, :]), FAST), tl.trans(kx), input_precision=PREC_TC))
    tl.store(aqk_ptr + blk * (C * C) + ri * C + ci, tl.where(ri >= ci, aqk, 0.0).to(dt))
    A = tl.where(ri > ci, beta[:, None] * akk, 0.0)
    Tinv = unit_lower_inverse(A, C, LOG2C, PREC_TC)
    tl.store(w_ptr + tile, tl.dot(Tinv, kbeta, input_precision=PREC_TC).to(dt))
    v = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              2 * P + h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    tl.store(u_ptr + tile, tl.dot(Tinv, beta[:, None] * v, input_precision=PREC_TC).to(dt))
    tl.store(gam_ptr + blk * D + cols, _exp_accurate(g_last))



@triton.jit
def _prepare_chunk_unbounded(
    qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h,
    cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, q_scale, L, anchor_spread,
    h, blk, t0, tok, valid, seq_start, init,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOG2C: tl.constexpr, W: tl.constexpr,
    PREC_TC: tl.constexpr, FAST: tl.constexpr, ANCHORED: tl.constexpr, BLOCKED: tl.constexpr,
):
    """One chunk of one head, unbounded gate, the exact launch (one program per chunk, so the conv
    history is decided per chunk): the anchored halves where their spread allows (ANCHORED), the
    fallback elsewhere: the blocked factorization (BLOCKED) or the exact column loop. Both need q, k
    and g at once, so no order frees registers here; this layout (the three convs inside one
    per-chunk branch) spills least of those tried (docs/flash-prefill.md)."""
    rows = tl.arange(0, C)
    cols = tl.arange(0, D)
    ri = rows[:, None]
    ci = rows[None, :]
    P = H * D
    if t0 - seq_start >= W - 1:
        q = _conv_silu_no_history(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, h * D + cols, tok, valid, W, FAST)
        k = _conv_silu_no_history(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, P + h * D + cols, tok, valid, W, FAST)
        v = _conv_silu_no_history(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, 2 * P + h * D + cols, tok, valid, W,
                                  FAST)
    else:
        q = _conv_silu(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
                       h * D + cols, tok, valid, seq_start, init, L, W, FAST)
        k = _conv_silu(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
                       P + h * D + cols, tok, valid, seq_start, init, L, W, FAST)
        v = _conv_silu(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
                       2 * P + h * D + cols, tok, valid, seq_start, init, L, W, FAST)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * q_scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    g, g_last, beta = _gate_beta(forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h,
                                 a_log_ptr, dt_bias_ptr, 0.0, h, tok, valid, rows, cols, D, C, False, FAST)
    eg = fast_exp(g, FAST)
    e_dn = fast_exp(g_last[None, :] - g, FAST)
    if ANCHORED:
        # Both halves' decay spreads within fp32/tf32 range (per channel, the largest of them):
        # tensor-core dots; otherwise (a very strong decay in this chunk) the fallback.
        g_m = tl.sum(tl.where(ri == C // 2 - 1, g, 0.0), axis=0)
        spread = tl.max(tl.maximum(-g_m, g_m - g_last), axis=0)
        if spread <= anchor_spread:
            akk, aqk = _intra_anchored_halves(q, k, g, g_m, g_last, rows, C, PREC_TC, FAST)
        elif BLOCKED:
            akk, aqk = _intra_blocked(q, k, g, rows, C, PREC_TC, FAST)
        else:
            akk, aqk = _intra_exact(q, k, g, rows, C, FAST)
    elif BLOCKED:
        akk, aqk = _intra_blocked(q, k, g, rows, C, PREC_TC, FAST)
    else:
        akk, aqk = _intra_exact(q, k, g, rows, C, FAST)
    A = tl.where(ri > ci, beta[:, None] * akk, 0.0)
    aqk = tl.where(ri >= ci, aqk, 0.0)
    Tinv = unit_lower_inverse(A, C, LOG2C, PREC_TC)
    w = tl.dot(Tinv, (beta[:, None] * k) * eg, input_precision=PREC_TC)
    u = tl.dot(Tinv, beta[:, None] * v, input_precision=PREC_TC)
    tile = blk * (C * D) + ri * D + cols[None, :]
    dt = w_ptr.dtype.element_ty
    tl.store(w_ptr + tile, w.to(dt))
    tl.store(u_ptr + tile, u.to(dt))
    tl.store(qg_ptr + tile, (q * eg).to(dt))
    tl.store(kd_ptr + tile, (k * e_dn).to(dt))
    tl.store(aqk_ptr + blk * (C * C) + ri * C + ci, aqk.to(dt))
    tl.store(gam_ptr + blk * D + cols, _exp_accurate(g_last))


@triton.jit
def flash_prepare_kernel(
    qkv_ptr, stride_qkv,
    forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d,
    b_ptr, stride_b_t, stride_b_h,
    cw_ptr, stride_cw_c, stride_cw_j,
    cs_ptr, stride_cs_slot, stride_cs_row, stride_cs_ch,
    a_log_ptr, dt_bias_ptr,
    cu_ptr, idx_ptr, init_ptr,
    chunk_seq_ptr, chunk_tok_ptr, seq_seg0_ptr, seg_chunk_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, flag_ptr,
    lower_bound, q_scale, L, anchor_spread,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOG2C: tl.constexpr, W: tl.constexpr,
    BOUNDED: tl.constexpr, PREC_TC: tl.constexpr, FAST: tl.constexpr, FIRST: tl.constexpr, NFIRST: tl.constexpr,
    EXACT: tl.constexpr, FLAGGED_ONLY: tl.constexpr, HALVES: tl.constexpr, BLOCKED: tl.constexpr,
):
    """Two launches of this kernel cover every chunk. FIRST = False: one program per (chunk, head),
    skipping the chunks whose conv window reaches before their sequence's first token; FIRST =
    True: one program per (sequence, head, k < NFIRST) for exactly those chunks (the k-th of each
    sequence, NFIRST = ceil((W-1) / C)), reading the history rows from the conv-state pool. Two
    straight-line kernels instead of one with a branch: ptxas schedules (and allocates registers
    for) the common path alone, and it carries none of the history code.

    Unbounded gate: those two launches (the first pass) factor A and Aqk around one anchor per chunk
    (HALVES = False, the bounded path's code) or per half (HALVES = True), and flag the chunks
    beyond that factorization's range (flag_ptr, one byte per (chunk, head)); then EXACT = True,
    one program per (chunk, head), recomputes the flagged chunks (FLAGGED_ONLY) by the halves where
    they fit (HALVES, after a one-anchor first pass) and the fallback elsewhere (BLOCKED: the
    blocked factorization, else the exact column loop), or every chunk with the fallback
    (FlashConfig.unbounded_anchored = False: the only launch)."""
    pid = tl.program_id(0)
    if FIRST:
        f = pid % NFIRST
        h = (pid // NFIRST) % H
        n = pid // (NFIRST * H)
        j = tl.load(seg_chunk_ptr + tl.load(seq_seg0_ptr + n)) + f
    else:
        j = pid // H
        h = pid % H
        n = tl.load(chunk_seq_ptr + j)
        if n < 0:
            return
    blk = j.to(tl.int64) * H + h
    if EXACT and FLAGGED_ONLY:
        if tl.load(flag_ptr + blk) == 0:
            return
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot <= 0:
        return
    seq_start = tl.load(cu_ptr + n)
    seq_end = tl.load(cu_ptr + n + 1)
    if FIRST:
        t0 = seq_start + f * C
        if t0 >= seq_end:          # a sequence shorter than k chunks (or empty): no such chunk
            return
    else:
        t0 = tl.load(chunk_tok_ptr + j)
        if not EXACT and t0 - seq_start < W - 1:  # the FIRST launch's chunk
            return
    init = tl.load(init_ptr + n) != 0
    tok = t0 + tl.arange(0, C)
    valid = tok < seq_end
    hist = cs_ptr + slot * stride_cs_slot
    if EXACT:
        _prepare_chunk_unbounded(qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr,
                                 stride_b_t, stride_b_h, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
                                 a_log_ptr, dt_bias_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, q_scale, L,
                                 anchor_spread, h, blk, t0, tok, valid, seq_start, init, H, D, C, LOG2C, W, PREC_TC,
                                 FAST, HALVES, BLOCKED)
    elif BOUNDED or not HALVES:
        _prepare_chunk(qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t,
                       stride_b_h, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, a_log_ptr,
                       dt_bias_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, flag_ptr, lower_bound, q_scale, L,
                       anchor_spread, h, blk, tok, valid, seq_start, init, H, D, C, LOG2C, W, PREC_TC, FAST, FIRST, BOUNDED)
    else:
        _prepare_chunk_unbounded_halves(qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d,
                                        b_ptr, stride_b_t, stride_b_h, cw_ptr, stride_cw_c, stride_cw_j, hist,
                                        stride_cs_row, stride_cs_ch, a_log_ptr, dt_bias_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr,
                                        aqk_ptr, gam_ptr, flag_ptr, q_scale, L, anchor_spread, h, blk, tok, valid,
                                        seq_start, init, H, D, C, LOG2C, W, PREC_TC, FAST, FIRST)
