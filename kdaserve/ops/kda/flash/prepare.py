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
  gate has no such bound. With 16-bit workspaces it clamps each token's log-decay at -10 inside
  the chunk's factors (a factor across a clamped token is below e^-10 both truly and as computed,
  under 16-bit rounding), so one anchor spans 16 tokens; 32-token chunks join two anchored halves
  (_prepare_chunk_pair). Exact for any decay (fp32 workspaces): nested anchors (_intra_nested).
- T by recursive blocking: T_2b = T_b - T_b A_off T_b doubles the solved diagonal blocks; every
  product is of bounded entries of the final inverse, unlike a Neumann/doubling product whose
  powers of A grow when decay is slow. Its products, and W's and U~'s, take fp16 operands with a
  16-bit workspace (INV_DT; FlashConfig.prepare_half_dots): tf32's 10-bit mantissa, every operand
  within fp16's range (entries of T, e^g <= 1, values the workspace holds in fp16 anyway), half the
  registers and tensor-core instructions. A and Aqk keep tf32: their anchored factors span e^(+-80).
  tf32x3 would cost 14% more instructions in this latency-bound kernel for accuracy the fp16
  workspace drops anyway.
- The loads: 2-4 programs of 4 warps per SM (by its registers) are too few to hide a DRAM round
  trip, so with PREFETCH a program first asks for its chunk's q|k|v and forget-logit lines in L1
  (PTX prefetch, no registers held) and its later loads find them there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.kda.flash.fastmath import fast_exp, fast_rcp, fast_sigmoid, sigmoid_tanh
from kdaserve.ops.kda.tri_inverse import unit_lower_inverse
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
def _prefetch_l1(ptrs):
    """Ask for each address's 128-byte line in L1, without waiting or holding a register (PTX
    `prefetch.global.L1`; NVIDIA only, like the other inline assembly here)."""
    tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_chunk(qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, tok, h,
                    H: tl.constexpr, D: tl.constexpr):
    """Start the chunk's q, k, v and forget-logit rows of head h (tokens `tok`, each inside the step)
    on their way to L1 before any of them is loaded: K1's registers leave 2-4
    programs of 4 warps per SM, too few to hide a DRAM round trip at each of its four load phases
    (Nsight Compute, at 2 programs per SM: a third of its stall samples there; docs/perf-notes.md,
    thirtieth session)."""
    LINE: tl.constexpr = 1024 // qkv_ptr.dtype.element_ty.primitive_bitwidth   # elements per 128-byte line
    NL: tl.constexpr = D // LINE if D >= LINE else 1
    line = (tl.arange(0, NL) * LINE)[None, :]
    t64 = tok.to(tl.int64)[:, None]
    rows = qkv_ptr + t64 * stride_qkv + h * D + line
    for t in tl.static_range(3):
        _prefetch_l1(rows + t * (H * D))
    _prefetch_l1(forget_ptr + t64 * stride_forget_t + h * stride_forget_h + line * stride_forget_d)


@triton.jit
def _block_anchor(g, C: tl.constexpr, LEVEL: tl.constexpr):
    NB: tl.constexpr = C >> (LEVEL + 1)
    BB: tl.constexpr = 2 << LEVEL
    g3 = tl.reshape(g, (NB, BB, g.shape[1]))
    jj = tl.arange(0, BB)[None, :, None]
    a = tl.sum(tl.where(jj == (1 << LEVEL) - 1, g3, 0.0), axis=1)
    return tl.reshape(tl.broadcast_to(a[:, None, :], (NB, BB, g.shape[1])), g.shape)


@triton.jit
def _intra_nested(q, k, g, gk, rows, C: tl.constexpr, LOG2C: tl.constexpr, OPDT: tl.constexpr, PREC: tl.constexpr,
                  FAST: tl.constexpr):
    """A_kk[t,i] = sum_c k_t k_i e^(g_t - g_i) and A_qk likewise (i <= t; the module docstring) for
    any decay, all on tensor cores, by nested anchors. A pair
    (t, i), i < t, whose row numbers first differ in bit l lies in one aligned block of 2^(l+1)
    rows, t in its second half and i in its first; around g at the last row a of that first half
    both factors e^(g_t - g_a) and e^(g_a - g_i) are <= 1, since g never increases along a chunk
    (an underflow means a true product below the operands' range anyway, a negligible term). So
    one dot per level l and matrix, of the rows scaled by their level-l factor (a row's anchor at
    level l depends on the row alone, for both roles), whose entries are kept where the pair's
    highest differing bit is l: every pair once, whatever the decay. Every factor is at most 1, so
    the operands fit fp16 (OPDT; the workspace's type) as well as fp32, and no entry selected away
    can be inf."""
    ri = rows[:, None]
    ci = rows[None, :]
    diff = ri ^ ci
    akk = tl.zeros([C, C], dtype=tl.float32)
    aqk = tl.where(ri == ci, tl.sum(q * k, axis=1)[:, None], 0.0)     # the diagonal: e^0
    for l in tl.static_range(LOG2C):
        if l == 0:
            # e^(g_t - g_(t-1)) for odd t; an even i is its own anchor
            f = tl.where((((rows & 1) == 1))[:, None], fast_exp(gk, FAST), 1.0)
        else:
            f = fast_exp(-tl.abs(g - _block_anchor(g, C, l)), FAST)
        kf = (k * f).to(OPDT)
        mine = ((diff >> l) == 1) & (ri > ci)        # pairs whose highest differing bit is l
        akk = tl.where(mine, tl.dot(kf, tl.trans(kf), input_precision=PREC), akk)
        aqk = tl.where(mine, tl.dot((q * f).to(OPDT), tl.trans(kf), input_precision=PREC), aqk)
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
def _gate_beta(forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h, a_log_ptr,
               dt_bias_ptr,
               lower_bound, h, tok, valid, rows, cols, D: tl.constexpr, C: tl.constexpr, BOUNDED: tl.constexpr,
               FAST: tl.constexpr, decay_clamp=0.0, CLAMPED: tl.constexpr = False, GATE_DT: tl.constexpr = tl.float32):
    """The in-chunk cumulative log-decay g [C, D], its last row g_C, beta [C] (0 past the end), the
    per-token log-decay gk [C, D] it sums, and the chunk's true decay g_end [D]. CLAMPED (the
    unbounded gate's clamped pass): g sums max(gk, -decay_clamp) instead, so its spread within the
    chunk is at most C * decay_clamp; g_end stays the true sum (the chunk decay compounds).
    GATE_DT: gk rounded to this dtype first (Ling-3, KDAWeights.gate_dtype; fp32: no rounding)."""
    x = tl.load(forget_ptr + tok.to(tl.int64)[:, None] * stride_forget_t + h * stride_forget_h + cols[None, :] * stride_forget_d,
                mask=valid[:, None], other=0.0).to(tl.float32)
    x += tl.load(dt_bias_ptr + h * D + cols).to(tl.float32)[None, :]
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))  # one value: precise
    if BOUNDED:
        gk = lower_bound * fast_sigmoid(a * x, FAST)
    else:
        gk = -a * softplus(x)
    gk = gk.to(GATE_DT).to(tl.float32)   # Ling-3's rounding (KDAWeights.gate_dtype); fp32: none
    gk = tl.where(valid[:, None], gk, 0.0)
    if CLAMPED:
        g_end = tl.sum(gk, axis=0)
        gk = tl.maximum(gk, -decay_clamp)
    g = tl.cumsum(gk, axis=0)
    g_last = tl.sum(tl.where(rows[:, None] == C - 1, g, 0.0), axis=0)
    if not CLAMPED:
        g_end = g_last
    bl = tl.load(b_ptr + tok.to(tl.int64) * stride_b_t + h * stride_b_h, mask=valid, other=0.0).to(tl.float32)
    beta = tl.where(valid, fast_sigmoid(bl, FAST), 0.0)
    return g, g_last, beta, gk, g_end


@triton.jit
def _prepare_chunk(
    qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h,
    cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, lower_bound, q_scale, L, decay_clamp,
    h, blk, tok, valid, seq_start, init,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOG2C: tl.constexpr, W: tl.constexpr,
    PREC_TC: tl.constexpr, FAST: tl.constexpr, HIST: tl.constexpr, BOUNDED: tl.constexpr, INV_DT: tl.constexpr,
    GATE_DT: tl.constexpr = tl.float32,
):
    """One chunk of one head, one anchor: the bounded gate (|g| <= 5 C, always in range), or the
    unbounded gate clamped (BOUNDED = False: every token's log-decay clamped at -decay_clamp, so
    |g_C| <= 16 x 10; the chunk decay gam stays the true one). HIST: the conv window reaches
    before the sequence's first token (its first chunk), so the conv reads history rows; without,
    a separate inlined copy carries none of that code or its registers.

    In the order that keeps the fewest [C, D] tiles live (K1 is occupancy-bound: registers decide
    how many programs share an SM; docs/perf-notes.md, thirtieth session): the gate first, then q
    (Qg stored at once: only q e^(g - a) stays), then k (Kd stored; both products of k formed
    together), then v, each convolved when first needed and dropped after its last use; beta k e^g
    kept in the W product's operand type. q goes first because it leaves one tile (q e^(g - a))
    live while k is convolved, where k would leave two (k e^(a - g), k e^(g - a)) while q is: what
    lets the bounded K1 run under a 168-register cap (3 programs per SM) and the unbounded one at
    C = 16 in 128 registers.
    Two exponentials per element: e_up = e^(g - a) in e^(+-40) (C = 16) or e^(+-80) (C = 32), its
    reciprocal, and e^a per channel give every factor without overflow."""
    rows = tl.arange(0, C)
    cols = tl.arange(0, D)
    ri = rows[:, None]
    ci = rows[None, :]
    P = H * D
    tile = blk * (C * D) + ri * D + cols[None, :]
    dt = w_ptr.dtype.element_ty
    g, g_last, beta, _, g_end = _gate_beta(forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t,
                                           stride_b_h, a_log_ptr, dt_bias_ptr, lower_bound, h, tok, valid, rows, cols, D, C,
                                           BOUNDED, FAST, decay_clamp, not BOUNDED, GATE_DT)
    anchor = 0.5 * g_last
    ea = fast_exp(anchor, FAST)[None, :]
    e_up = fast_exp(g - anchor[None, :], FAST)
    q = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    qe = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * q_scale)[:, None] * e_up
    tl.store(qg_ptr + tile, (qe * ea).to(dt))   # Qg = q e^g
    k = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              P + h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    kb = k * fast_rcp(e_up, FAST)   # k e^(a - g)
    ke = k * e_up                   # k e^(g - a)
    tl.store(kd_ptr + tile, (kb * ea).to(dt))   # Kd = k e^(g_C - g) = k e^a e^(a - g), as g_C = 2a
    akk = tl.dot(ke, tl.trans(kb), input_precision=PREC_TC)
    aqk = tl.dot(qe, tl.trans(kb), input_precision=PREC_TC)
    kbeta = ((beta[:, None] * ke) * ea).to(INV_DT)   # beta k e^g, in the W product's operand type
    A = tl.where(ri > ci, beta[:, None] * akk, 0.0)
    tl.store(aqk_ptr + blk * (C * C) + ri * C + ci, tl.where(ri >= ci, aqk, 0.0).to(dt))
    Tinv = unit_lower_inverse(A, C, LOG2C, PREC_TC, INV_DT).to(INV_DT)
    tl.store(w_ptr + tile, tl.dot(Tinv, kbeta, input_precision=PREC_TC).to(dt))
    v = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              2 * P + h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    tl.store(u_ptr + tile, tl.dot(Tinv, (beta[:, None] * v).to(INV_DT), input_precision=PREC_TC).to(dt))
    tl.store(gam_ptr + blk * D + cols, _exp_accurate(g_end))


@triton.jit
def _one_anchor(q, k, g, g_last, beta, rows, C: tl.constexpr, LOG2C: tl.constexpr, PREC_TC: tl.constexpr,
                FAST: tl.constexpr, INV_DT: tl.constexpr):
    """One chunk's factors around one anchor, the midpoint of its decay (every exponent within
    e^(+-spread/2)): Qg = q e^g, Kd = k e^(g_C - g), X = beta k e^g, Aqk (zero above the diagonal)
    and T^-1 = (I + strictly lower(beta A_kk))^-1 (in INV_DT, the type of its products' operands)."""
    ri = rows[:, None]
    ci = rows[None, :]
    anchor = 0.5 * g_last
    ea = fast_exp(anchor, FAST)[None, :]
    e_up = fast_exp(g - anchor[None, :], FAST)
    kb = k * fast_rcp(e_up, FAST)   # k e^(a - g)
    ke = k * e_up                   # k e^(g - a)
    qe = q * e_up
    akk = tl.dot(ke, tl.trans(kb), input_precision=PREC_TC)
    aqk = tl.dot(qe, tl.trans(kb), input_precision=PREC_TC)
    Tinv = unit_lower_inverse(tl.where(ri > ci, beta[:, None] * akk, 0.0), C, LOG2C, PREC_TC, INV_DT).to(INV_DT)
    return qe * ea, kb * ea, (beta[:, None] * ke) * ea, tl.where(ri >= ci, aqk, 0.0), Tinv


@triton.jit
def _qk_normed(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, h, cols, tok, valid,
               seq_start, init, L, q_scale, H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, FAST: tl.constexpr,
               HIST: tl.constexpr):
    """A tile's q (l2-normalized, times the D^-0.5 scale) and k (l2-normalized), after conv + SiLU."""
    P = H * D
    k = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              P + h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    q = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * q_scale)[:, None]
    return q, k


@triton.jit
def _prepare_chunk_pair(
    qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h,
    cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, q_scale, L, decay_clamp,
    h, blk, t0, seq_end, seq_start, init,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOG2C: tl.constexpr, W: tl.constexpr,
    PREC_TC: tl.constexpr, FAST: tl.constexpr, HIST: tl.constexpr, INV_DT: tl.constexpr,
    GATE_DT: tl.constexpr = tl.float32,
):
    """One C-token chunk of one head (C = 32), unbounded gate, clamped pass: its two halves a and b
    each by one anchor on the clamped decay (as _prepare_chunk at C/2, every factor in range), then
    joined into the chunk's workspace so the recurrence takes C-token steps. With G_a, G_b the
    halves' true decays (e^G <= 1) and ' marking a half's own factors:
      Qg_b = Qg_b' e^(G_a),  Kd_a = Kd_a' e^(G_b),  gam = e^(G_a + G_b),
      Aqk_ba = Qg_b' Kd_a'^T (a row of b, a column of a: e^(g_t - g_i) exactly, factors <= 1),
    and T = [[T_a, 0], [B, T_b]] with B = X_b' Kd_a'^T, so by the block inverse
      W_b = T_b^-1 (X_b' e^(G_a) - B W_a),  U_b = T_b^-1 (beta_b v_b - B U_a).
    Every dot is [C/2, C/2] or [C/2, D]: the registers of a C/2 chunk plus W_a, U_a and Kd_a', where
    one [C, D] tile's factorization by halves spilled (docs/flash-prefill.md)."""
    HC: tl.constexpr = C // 2
    rows = tl.arange(0, HC)
    cols = tl.arange(0, D)
    ri = rows[:, None]
    ci = rows[None, :]
    P = H * D
    tile = blk * (C * D) + ri * D + cols[None, :]        # half a's rows; half b's: + HC * D
    sq = blk * (C * C) + ri * C + ci                     # Aqk's [a, a] block; [b, b]: + HC * (C + 1)
    dt = w_ptr.dtype.element_ty
    tok_a = t0 + rows
    tok_b = tok_a + HC
    valid_a = tok_a < seq_end
    valid_b = tok_b < seq_end
    g_a, gl_a, beta_a, _, G_a = _gate_beta(forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t,
                                           stride_b_h, a_log_ptr, dt_bias_ptr, 0.0, h, tok_a, valid_a, rows, cols, D, HC,
                                           False, FAST, decay_clamp, True, GATE_DT)
    g_b, gl_b, beta_b, _, G_b = _gate_beta(forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t,
                                           stride_b_h, a_log_ptr, dt_bias_ptr, 0.0, h, tok_b, valid_b, rows, cols, D, HC,
                                           False, FAST, decay_clamp, True, GATE_DT)
    eGa = _exp_accurate(G_a)[None, :]
    eGb = _exp_accurate(G_b)[None, :]
    tl.store(gam_ptr + blk * D + cols, _exp_accurate(G_a + G_b))
    # half a
    q, k = _qk_normed(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, h, cols,
                      tok_a, valid_a, seq_start, init, L, q_scale, H, D, W, FAST, HIST)
    qg, kd_a, x, aqk, Tinv = _one_anchor(q, k, g_a, gl_a, beta_a, rows, HC, LOG2C - 1, PREC_TC, FAST, INV_DT)
    tl.store(qg_ptr + tile, qg.to(dt))
    tl.store(kd_ptr + tile, (kd_a * eGb).to(dt))
    kd_a = kd_a.to(INV_DT)
    tl.store(aqk_ptr + sq, aqk.to(dt))
    tl.store(aqk_ptr + sq + HC, tl.zeros([HC, HC], dtype=dt))   # [a, b]: above the diagonal
    w_a = tl.dot(Tinv, x.to(INV_DT), input_precision=PREC_TC)
    tl.store(w_ptr + tile, w_a.to(dt))
    w_a = w_a.to(INV_DT)            # kept for the join, in its operand type
    v = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              2 * P + h * D + cols, tok_a, valid_a, seq_start, init, L, W, FAST, HIST)
    u_a = tl.dot(Tinv, (beta_a[:, None] * v).to(INV_DT), input_precision=PREC_TC)
    tl.store(u_ptr + tile, u_a.to(dt))
    u_a = u_a.to(INV_DT)
    # half b, then the joins; its conv window reaches before the sequence only if W - 1 > C/2
    HIST_B: tl.constexpr = HIST and W - 1 > HC
    q, k = _qk_normed(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, h, cols,
                      tok_b, valid_b, seq_start, init, L, q_scale, H, D, W, FAST, HIST_B)
    qg, kd, x, aqk, Tinv = _one_anchor(q, k, g_b, gl_b, beta_b, rows, HC, LOG2C - 1, PREC_TC, FAST, INV_DT)
    tl.store(qg_ptr + tile + HC * D, (qg * eGa).to(dt))
    tl.store(kd_ptr + tile + HC * D, kd.to(dt))
    tl.store(aqk_ptr + sq + HC * (C + 1), aqk.to(dt))
    kda_t = tl.trans(kd_a)
    tl.store(aqk_ptr + sq + HC * C, tl.dot(qg.to(INV_DT), kda_t, input_precision=PREC_TC).to(dt))
    B = tl.dot(x.to(INV_DT), kda_t, input_precision=PREC_TC).to(INV_DT)
    x = x * eGa - tl.dot(B, w_a, input_precision=PREC_TC)
    tl.store(w_ptr + tile + HC * D, tl.dot(Tinv, x.to(INV_DT), input_precision=PREC_TC).to(dt))
    v = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              2 * P + h * D + cols, tok_b, valid_b, seq_start, init, L, W, FAST, HIST_B)
    v = beta_b[:, None] * v - tl.dot(B, u_a, input_precision=PREC_TC)
    tl.store(u_ptr + tile + HC * D, tl.dot(Tinv, v.to(INV_DT), input_precision=PREC_TC).to(dt))


@triton.jit
def _prepare_chunk_nested(
    qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t, stride_b_h,
    cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, q_scale, L,
    h, blk, tok, valid, seq_start, init,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOG2C: tl.constexpr, W: tl.constexpr,
    PREC_TC: tl.constexpr, FAST: tl.constexpr, HIST: tl.constexpr, GATE_DT: tl.constexpr = tl.float32,
):
    """One chunk of one head, unbounded gate, in one pass for any decay: A and Aqk by nested
    anchors (_intra_nested), no clamp, no anchor range to exceed. Straight-line code in the bounded
    path's order (k, q, v convolved when first needed, outputs stored as soon as they exist); every
    other factor is e^(something <= 0): Qg = q e^g, Kd = k e^(g_C - g), W from beta k e^g."""
    rows = tl.arange(0, C)
    cols = tl.arange(0, D)
    ri = rows[:, None]
    ci = rows[None, :]
    P = H * D
    tile = blk * (C * D) + ri * D + cols[None, :]
    dt = w_ptr.dtype.element_ty
    g, g_last, beta, gk, _ = _gate_beta(forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t,
                                        stride_b_h,
                                 a_log_ptr, dt_bias_ptr, 0.0, h, tok, valid, rows, cols, D, C, False, FAST,
                                 GATE_DT=GATE_DT)
    k = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              P + h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    tl.store(kd_ptr + tile, (k * fast_exp(g_last[None, :] - g, FAST)).to(dt))   # Kd = k e^(g_C - g)
    q = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * q_scale)[:, None]
    eg = fast_exp(g, FAST)
    tl.store(qg_ptr + tile, (q * eg).to(dt))                                    # Qg = q e^g
    akk, aqk = _intra_nested(q, k, g, gk, rows, C, LOG2C, dt, PREC_TC, FAST)
    tl.store(aqk_ptr + blk * (C * C) + ri * C + ci, tl.where(ri >= ci, aqk, 0.0).to(dt))
    A = tl.where(ri > ci, beta[:, None] * akk, 0.0)
    Tinv = unit_lower_inverse(A, C, LOG2C, PREC_TC)
    tl.store(w_ptr + tile, tl.dot(Tinv, (beta[:, None] * k) * eg, input_precision=PREC_TC).to(dt))
    v = _conv(qkv_ptr, stride_qkv, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
              2 * P + h * D + cols, tok, valid, seq_start, init, L, W, FAST, HIST)
    tl.store(u_ptr + tile, tl.dot(Tinv, beta[:, None] * v, input_precision=PREC_TC).to(dt))
    tl.store(gam_ptr + blk * D + cols, _exp_accurate(g_last))


@triton.jit(do_not_specialize=["T"])   # the step's token count: one build for every step
def flash_prepare_kernel(
    qkv_ptr, stride_qkv,
    forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d,
    b_ptr, stride_b_t, stride_b_h,
    cw_ptr, stride_cw_c, stride_cw_j,
    cs_ptr, stride_cs_slot, stride_cs_row, stride_cs_ch,
    a_log_ptr, dt_bias_ptr,
    cu_ptr, idx_ptr, init_ptr,
    chunk_seq_ptr, chunk_tok_ptr, seq_seg0_ptr, seg_chunk_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr,
    lower_bound, q_scale, L, decay_clamp, T,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOG2C: tl.constexpr, W: tl.constexpr,
    BOUNDED: tl.constexpr, PREC_TC: tl.constexpr, FAST: tl.constexpr, FIRST: tl.constexpr, NFIRST: tl.constexpr,
    NESTED: tl.constexpr, INV_DT: tl.constexpr = tl.float32, PREFETCH: tl.constexpr = False,
    GATE_DT: tl.constexpr = tl.float32,
):
    """Two launches of this kernel cover every chunk. FIRST = False: one program per (chunk, head),
    skipping the chunks whose conv window reaches before their sequence's first token; FIRST =
    True: one program per (sequence, head, k < NFIRST) for exactly those chunks (the k-th of each
    sequence, NFIRST = ceil((W-1) / C)), reading the history rows from the conv-state pool. Two
    straight-line kernels instead of one with a branch: ptxas schedules (and allocates registers
    for) the common path alone, and it carries none of the history code.

    Unbounded gate (BOUNDED = False), every chunk in the same two launches: clamped (16-bit
    workspaces) by one anchor per chunk at C = 16, or per half chunk, joined, at C = 32; or, with
    NESTED, exactly for any decay by nested anchors (fp32 workspaces, or by choice)."""
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
        t0 = tl.load(chunk_tok_ptr + j)
        # Before the sequence's table loads, rows clamped to the step's T tokens. Not in the FIRST
        # launch (one program per sequence and head; its t0 waits for the sequence's table anyway).
        if PREFETCH and T > 0:
            _prefetch_chunk(qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d,
                            tl.minimum(t0 + tl.arange(0, C), T - 1), h, H, D)
        if n < 0:
            return
    blk = j.to(tl.int64) * H + h
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
        if t0 - seq_start < W - 1:  # the FIRST launch's chunk
            return
    init = tl.load(init_ptr + n) != 0
    tok = t0 + tl.arange(0, C)
    valid = tok < seq_end
    hist = cs_ptr + slot * stride_cs_slot
    if NESTED:
        _prepare_chunk_nested(qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr,
                              stride_b_t, stride_b_h, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
                              a_log_ptr, dt_bias_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, q_scale, L, h, blk,
                              tok, valid, seq_start, init, H, D, C, LOG2C, W, PREC_TC, FAST, FIRST, GATE_DT)
    elif not BOUNDED and C == 32:
        _prepare_chunk_pair(qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr,
                            stride_b_t, stride_b_h, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch,
                            a_log_ptr, dt_bias_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, q_scale, L, decay_clamp,
                            h, blk, t0, seq_end, seq_start, init, H, D, C, LOG2C, W, PREC_TC, FAST, FIRST, INV_DT,
                            GATE_DT)
    else:
        _prepare_chunk(qkv_ptr, stride_qkv, forget_ptr, stride_forget_t, stride_forget_h, stride_forget_d, b_ptr, stride_b_t,
                       stride_b_h, cw_ptr, stride_cw_c, stride_cw_j, hist, stride_cs_row, stride_cs_ch, a_log_ptr,
                       dt_bias_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, lower_bound, q_scale, L, decay_clamp,
                       h, blk, tok, valid, seq_start, init, H, D, C, LOG2C, W, PREC_TC, FAST, FIRST, BOUNDED, INV_DT,
                       GATE_DT)
