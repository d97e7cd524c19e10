"""Stage 2 of chunked prefill with 64-row tiles: the same outputs as intra.py, shaped for tensor cores.

intra.py works on 16-row sub-blocks: its A/Aqk dots are [16, K] x [K, 16], which Triton maps with
every warp along M = 16 (warpsPerCTA [8, 1]), so each of the 8 warps computes the same product and
holds both [16, 128] fp32 operands in registers (64 registers each): the kernel sits at 255
registers, spills, and runs one CTA per SM. Here every dot has 64 rows:

    A[:, J], Aqk[:, J]   column block J of all 64 rows: [64, KS] x [KS, 16] over channel slices
    X = (I + A)^-1       one [64, 64] tile, recursive 2x2 blocking (6 levels, 64-row dots)
    w, u                 X [64, 64] x [64, KS] per channel slice

Exponents, column block J anchored at a_J = g at J's last valid token (per channel):
2^(g_t - g_i) = 2^(g_t - a_J) * 2^(a_J - g_i). The right factor (i in J) has exponent <= 0 for any
gate. The left one: rows after block J have exponent <= 0 (a right-factor underflow then means a
true product below 2^-126 too); rows of block J itself lie in [0, 108] for the bounded gate
(LB >= -5: 15 steps of at most 7.2), inside fp32 range; rows before J are discarded and their
exponent is clamped to 112 only to keep them finite. For the unbounded gate no bound holds on block J's own rows, so the diagonal blocks
are built exactly column by column as in intra.py (EXACT_DIAG) and replace those rows.

A goes through an fp32 scratch [T, H, BT] (written by this program, read back after a CTA barrier)
because Triton cannot place [64, 16] column blocks into one [64, 64] register tile. l2norm is
folded into the operands as inverse row norms computed once (the channel-sliced dots read raw k
and q slices, normalized on the fly: unit rows keep the anchored sums far from fp32's range);
the slices (KS channels) bound the registers. SLICE_OUTER (the default) runs the slices outermost
so each q/k/g slice is loaded, converted and normalized once for all four column blocks: 19% fewer
SASS instructions (6680 vs 8240 per warp, bounded gate, 8 warps) for 252 registers instead of 195,
both one CTA per SM; the column-block-outer order is the one to combine with a register cap.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.chunk.intra import _diag_block, _load_rows
from kdaserve.ops.tri_inverse import unit_lower_inverse


@triton.jit
def _inv_norm(x):
    return tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)


@triton.jit
def _column_block(q_ptr, k_ptr, g_ptr, stride_y, stride_g, t0, t1, r, rows, m, rq, rk, beta,
                  J: tl.constexpr, BCC: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, PREC: tl.constexpr):
    """(A, Aqk)[:, J] for all BT rows, unmasked (rows before J hold finite garbage: the caller selects)."""
    rows_j = (t0 + J * BCC + tl.arange(0, BCC)).to(tl.int64)
    m_j = rows_j < t1
    last_j = (tl.minimum(t0 + (J + 1) * BCC, t1) - 1).to(tl.int64)  # J's last valid token
    rk_j = _inv_norm(_load_rows(k_ptr, rows_j, m_j, stride_y, K))
    P = tl.zeros([r.shape[0], BCC], dtype=tl.float32)
    Q = tl.zeros([r.shape[0], BCC], dtype=tl.float32)
    for c in tl.static_range(K // KS):
        cs = c * KS + tl.arange(0, KS)
        a_j = tl.load(g_ptr + last_j * stride_g + cs, mask=(last_j >= t0) & (cs < K), other=0.0)
        k_j = tl.load(k_ptr + rows_j[:, None] * stride_y + cs[None, :], mask=m_j[:, None], other=0.0).to(tl.float32)
        g_j = tl.load(g_ptr + rows_j[:, None] * stride_g + cs[None, :], mask=m_j[:, None], other=0.0)
        right = tl.trans(k_j * (rk_j[:, None] * tl.exp2(tl.minimum(a_j[None, :] - g_j, 0.0))))
        kc = tl.load(k_ptr + rows[:, None] * stride_y + cs[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        qc = tl.load(q_ptr + rows[:, None] * stride_y + cs[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        gc = tl.load(g_ptr + rows[:, None] * stride_g + cs[None, :], mask=m[:, None], other=0.0)
        # Clamp at 112 (>= the 108 of block J's own rows at LB = -5): with unit rows every sum stays
        # below 2^119, so even the discarded rows before J stay finite (no inf, no NaN anywhere).
        up = tl.exp2(tl.minimum(gc - a_j[None, :], 112.0))
        P = tl.dot(kc * (rk[:, None] * up), right, acc=P, input_precision=PREC)
        Q = tl.dot(qc * (rq[:, None] * up), right, acc=Q, input_precision=PREC)
    return P * beta[:, None], Q


@triton.jit
def _right_factor(k_ptr, g_ptr, stride_y, stride_g, t0, t1, cs, J: tl.constexpr, BCC: tl.constexpr, K: tl.constexpr):
    """Column side of block J on channel slice cs, transposed: (k_i / |k_i|) 2^(a_J - g_i), <= 1."""
    rows_j = (t0 + J * BCC + tl.arange(0, BCC)).to(tl.int64)
    m_j = rows_j < t1
    last_j = (tl.minimum(t0 + (J + 1) * BCC, t1) - 1).to(tl.int64)  # J's last valid token
    rk_j = _inv_norm(_load_rows(k_ptr, rows_j, m_j, stride_y, K))  # L1 hits after the first slice
    a_j = tl.load(g_ptr + last_j * stride_g + cs)
    k_j = tl.load(k_ptr + rows_j[:, None] * stride_y + cs[None, :], mask=m_j[:, None], other=0.0).to(tl.float32)
    g_j = tl.load(g_ptr + rows_j[:, None] * stride_g + cs[None, :], mask=m_j[:, None], other=0.0)
    return tl.trans(k_j * (rk_j[:, None] * tl.exp2(tl.minimum(a_j[None, :] - g_j, 0.0)))), a_j


@triton.jit
def _accumulate_block(P, Q, kn, qn, gc, right, a_j, PREC: tl.constexpr):
    up = tl.exp2(tl.minimum(gc - a_j[None, :], 112.0))  # clamp: see _column_block
    return tl.dot(kn * up, right, acc=P, input_precision=PREC), tl.dot(qn * up, right, acc=Q, input_precision=PREC)


@triton.jit
def _column_blocks_slice_outer(q_ptr, k_ptr, g_ptr, stride_y, stride_g, t0, t1, rows, m, rq, rk, beta,
                               BT: tl.constexpr, BCC: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
                               PREC: tl.constexpr):
    """All four (A, Aqk)[:, J] as _column_block computes them, channel slice outermost: each q/k/g
    slice is loaded, converted and normalized once for the four blocks (not once per block)."""
    P0 = tl.zeros([BT, BCC], dtype=tl.float32)
    P1, P2, P3, Q0, Q1, Q2, Q3 = P0, P0, P0, P0, P0, P0, P0
    for c in tl.static_range(K // KS):
        cs = c * KS + tl.arange(0, KS)
        kn = tl.load(k_ptr + rows[:, None] * stride_y + cs[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        kn = kn * rk[:, None]
        qn = tl.load(q_ptr + rows[:, None] * stride_y + cs[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        qn = qn * rq[:, None]
        gc = tl.load(g_ptr + rows[:, None] * stride_g + cs[None, :], mask=m[:, None], other=0.0)
        right, a_j = _right_factor(k_ptr, g_ptr, stride_y, stride_g, t0, t1, cs, 0, BCC, K)
        P0, Q0 = _accumulate_block(P0, Q0, kn, qn, gc, right, a_j, PREC)
        right, a_j = _right_factor(k_ptr, g_ptr, stride_y, stride_g, t0, t1, cs, 1, BCC, K)
        P1, Q1 = _accumulate_block(P1, Q1, kn, qn, gc, right, a_j, PREC)
        right, a_j = _right_factor(k_ptr, g_ptr, stride_y, stride_g, t0, t1, cs, 2, BCC, K)
        P2, Q2 = _accumulate_block(P2, Q2, kn, qn, gc, right, a_j, PREC)
        right, a_j = _right_factor(k_ptr, g_ptr, stride_y, stride_g, t0, t1, cs, 3, BCC, K)
        P3, Q3 = _accumulate_block(P3, Q3, kn, qn, gc, right, a_j, PREC)
    b = beta[:, None]
    return (P0 * b, P1 * b, P2 * b, P3 * b), (Q0, Q1, Q2, Q3)


@triton.jit
def _store_cols(ptr, x, rows, keep, col0, stride_t, BCC: tl.constexpr):
    cols = col0 + tl.arange(0, BCC)
    tl.store(ptr + rows[:, None] * stride_t + cols[None, :], x.to(ptr.dtype.element_ty), mask=keep[:, None])


@triton.jit
def chunk_intra_full_kernel(
    y, stride_y, beta_logits, stride_b_t, stride_b_h,
    gcum, chunks, state_indices,
    Aqk, akk_scratch, w, u, kg, qg,
    scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BCC: tl.constexpr, KS: tl.constexpr,
    EXACT_DIAG: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr, SLICE_OUTER: tl.constexpr,
):
    pid = tl.program_id(0)
    i_c = pid // H
    i_h = pid % H
    n = tl.load(chunks + i_c * 3)
    if tl.load(state_indices + n) <= 0:
        return
    t0 = tl.load(chunks + i_c * 3 + 1)
    t1 = tl.load(chunks + i_c * 3 + 2)

    q_ptr = y + i_h * K
    k_ptr = y + (H + i_h) * K
    v_ptr = y + (2 * H + i_h) * K
    g_ptr = gcum + i_h * K
    b_ptr = beta_logits + i_h * stride_b_h
    stride_g = H * K  # row stride of the [T, H, K] buffers
    stride_a = H * BT  # row stride of Aqk and of the A scratch, [T, H, BT]
    Aqk_h, akk_h = Aqk + i_h * BT, akk_scratch + i_h * BT
    w_h, u_h, kg_h, qg_h = w + i_h * K, u + i_h * K, kg + i_h * K, qg + i_h * K

    r = tl.arange(0, BT)
    rows = (t0 + r).to(tl.int64)
    m = rows < t1
    cols = tl.arange(0, K)
    offs = rows[:, None] * stride_g + cols[None, :]
    beta = tl.sigmoid(tl.load(b_ptr + rows * stride_b_t, mask=m, other=0.0).to(tl.float32))

    # ---- qg = q 2^g, kg = k 2^(g_last - g) (exponents <= 0), and the inverse row norms ----
    last = tl.minimum(t0 + BT, t1).to(tl.int64) - 1
    g_last = tl.load(g_ptr + last * stride_g + cols)
    g = _load_rows(g_ptr, rows, m, stride_g, K)
    q = _load_rows(q_ptr, rows, m, stride_y, K)
    rq = _inv_norm(q) * scale
    tl.store(qg_h + offs, (q * (rq[:, None] * tl.exp2(g))).to(qg_h.dtype.element_ty), mask=m[:, None])
    k = _load_rows(k_ptr, rows, m, stride_y, K)
    rk = _inv_norm(k)
    tl.store(kg_h + offs, (k * (rk[:, None] * tl.exp2(tl.minimum(g_last[None, :] - g, 0.0)))).to(kg_h.dtype.element_ty),
             mask=m[:, None])

    # ---- A and Aqk column block by column block; A to the scratch, Aqk out (lower blocks only) ----
    if SLICE_OUTER:
        Ps, Qs = _column_blocks_slice_outer(q_ptr, k_ptr, g_ptr, stride_y, stride_g, t0, t1, rows, m, rq, rk, beta,
                                            BT, BCC, K, KS, PREC)
    for J in tl.static_range(BT // BCC):
        if SLICE_OUTER:
            P, Q = Ps[J], Qs[J]
        else:
            P, Q = _column_block(q_ptr, k_ptr, g_ptr, stride_y, stride_g, t0, t1, r, rows, m, rq, rk, beta,
                                 J, BCC, K, KS, PREC)
        i_j = J * BCC + tl.arange(0, BCC)
        P = tl.where(r[:, None] > i_j[None, :], P, 0.0)
        Q = tl.where(r[:, None] >= i_j[None, :], Q, 0.0)
        first = (J + 1) * BCC if EXACT_DIAG else J * BCC  # exact diagonal blocks are stored below
        _store_cols(akk_h, P, rows, m & (r >= first), J * BCC, stride_a, BCC)
        _store_cols(Aqk_h, Q, rows, m & (r >= first), J * BCC, stride_a, BCC)
        if EXACT_DIAG:
            rows_j = (t0 + J * BCC + tl.arange(0, BCC)).to(tl.int64)
            m_j = rows_j < t1
            qn_j = _load_rows(q_ptr, rows_j, m_j, stride_y, K)
            qn_j = qn_j * (_inv_norm(qn_j) * scale)[:, None]
            kn_j = _load_rows(k_ptr, rows_j, m_j, stride_y, K)
            kn_j = kn_j * _inv_norm(kn_j)[:, None]
            g_j = _load_rows(g_ptr, rows_j, m_j, stride_g, K)
            b_j = tl.sigmoid(tl.load(b_ptr + rows_j * stride_b_t, mask=m_j, other=0.0).to(tl.float32))
            A_jj, Q_jj = _diag_block(qn_j, kn_j, g_j, m_j, g_last, k_ptr, g_ptr, stride_y, stride_g,
                                     t0 + J * BCC, t1, b_j, BCC, K, True, PREC)
            _store_cols(akk_h, A_jj, rows_j, m_j, J * BCC, stride_a, BCC)
            _store_cols(Aqk_h, Q_jj, rows_j, m_j, J * BCC, stride_a, BCC)

    # ---- X = (I + A)^-1 on the whole [BT, BT] tile ----
    # The loads read A entries stored by other threads of this program: a CTA barrier orders them.
    tl.debug_barrier()
    lower_blocks = (r[None, :] // BCC) <= (r[:, None] // BCC)  # blocks above were never stored
    A = tl.load(akk_h + rows[:, None] * stride_a + r[None, :], mask=m[:, None] & lower_blocks, other=0.0)
    X = unit_lower_inverse(A, BT, 6, INV_PREC)  # 6 = log2(BT)

    # ---- w = X (beta k 2^g), u = X (beta v), channel slice by channel slice ----
    for c in tl.static_range(K // KS):
        cs = c * KS + tl.arange(0, KS)
        so = rows[:, None] * stride_g + cs[None, :]
        kc = tl.load(k_ptr + rows[:, None] * stride_y + cs[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        gc = tl.load(g_ptr + so, mask=m[:, None], other=0.0)
        W = tl.dot(X, kc * ((beta * rk)[:, None] * tl.exp2(gc)), input_precision=PREC)
        tl.store(w_h + so, W.to(w_h.dtype.element_ty), mask=m[:, None])
        vc = tl.load(v_ptr + rows[:, None] * stride_y + cs[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        U = tl.dot(X, vc * beta[:, None], input_precision=PREC)
        tl.store(u_h + so, U.to(u_h.dtype.element_ty), mask=m[:, None])


def launch_intra_full(y, beta_logits, gcum, tables, state_indices, Aqk, akk_scratch, w, u, kg, qg, *,
                      exact_diag: bool, precision: str, inverse_precision: str, BT: int, BC: int, KS: int,
                      num_warps: int = 8, maxnreg: int | None = None, slice_outer: bool = False) -> None:
    """maxnreg caps registers per thread (ptxas spills the rest) so that more CTAs share an SM: at
    8 warps, 128 gives two CTAs per SM for ~250 B of spill (195 registers uncapped: one CTA)."""
    T, H, K = gcum.shape
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    chunk_intra_full_kernel[(tables.num_chunks * H,)](
        y, y.stride(0), beta_logits, beta_logits.stride(0), beta_logits.stride(1),
        gcum, tables.chunks, state_indices,
        Aqk, akk_scratch, w, u, kg, qg,
        K ** -0.5,
        H=H, K=K, BT=BT, BCC=BC, KS=min(KS, K), EXACT_DIAG=exact_diag, PREC=precision, INV_PREC=inverse_precision, SLICE_OUTER=slice_outer,
        num_warps=num_warps, **extra,
    )
