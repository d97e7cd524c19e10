"""Stage 2 of chunked prefill: everything inside one chunk that does not need the state.

One program per (chunk, head), BT = 64 tokens in four 16-token sub-blocks. With g the chunk-local
cumsum (log2 units, stage 1), q and k l2-normalized here (q also scaled by D^-0.5), beta = sigmoid:

    A[t, i]   = beta_t sum_c k_t k_i 2^(g_t - g_i)     (i < t)      16x16 blocks (fp32 scratch if WIDE)
    Aqk[t, i] =        sum_c q_t k_i 2^(g_t - g_i)     (i <= t)     -> Aqk [T, H, BT]
    X = (I + A)^-1 by 16x16 blocks (diagonal blocks by recursive blocking or forward substitution)
    w  = X (beta k 2^g)        u = X (beta v)                       -> w [T, H, K], u [T, H, V]
    kg = k 2^(g_last - g)      qg = q 2^g                           -> kg, qg [T, H, K]

Exponents (the only overflow hazard): a 64-token chunk spans up to ~462 in log2 units at LB = -5,
so 2^(g_t - g_i) is never formed from unanchored cumsums. Off-diagonal 16-blocks (row block I,
column block J < I) factor it through the anchor a = g at block I's first token:
2^(g_t - a) * 2^(a - g_i), both exponents <= 0 for any gate, so nothing overflows (an underflow to
0 only happens where the true product is below 2^-126 anyway). Diagonal blocks: for the bounded
gate the same anchor gives factors within 2^[-108, 108] (15 steps of at most 5 / ln 2), inside
fp32 range; for the unbounded gate no bound exists, so the diagonal blocks are built exactly,
column by column, with exponents g_t - g_i <= 0 (EXACT_DIAG).

Precision: everything is fp32; the matrix products take fp32 operands at PREC ("ieee" for fp32
inputs, "tf32" on GPU for 16-bit inputs: 10-bit operands, 8x finer than bf16). The inverse's dots
run at INV_PREC (ChunkConfig.intra_inverse_tf32: PREC, or always "ieee"); the diagonal 16x16
inverses by recursive blocking in registers (BLOCKED_INV) or by forward substitution in fp32 FMAs.
Only the results are rounded to the workspace dtype when stored (w, u, kg, qg, Aqk), as every
consumer feeds them to 16-bit tensor cores anyway.

A and Aqk come in one of two forms (WIDE, ChunkConfig.intra_wide). Per pair: one [16, K] x
[K, 16] dot per (row block, column block) and matrix; Triton cannot split M = N = 16 over 8 warps,
so every warp computes the same product and holds both operands (255 registers, 20-84 B of spill,
ptxas sm_90). Wide (default): row block I against the chunk's first 16 (I + 1) tokens (padded to
a power of two) in ONE dot per matrix, the warps splitting its 32-64 columns, with the same
factors (anchor at block I's first token; see _wide_row_block); A goes through an fp32 scratch
and comes back as 16x16 blocks after one barrier (216-255 registers, no spill; the faster form,
docs/perf-notes.md; designs tried and dropped: docs/chunk-prefill.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.tri_inverse import unit_lower_inverse
from kdaserve.ops.triton_math import l2_normalize_rows

BC = 16  # sub-block: the anchoring span and the size of the triangular blocks


@triton.jit
def _load_rows(ptr, rows, m, stride_t, K: tl.constexpr):
    """[len(rows), K] fp32 tile of rows (masked rows read as 0)."""
    cols = tl.arange(0, K)
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=m[:, None], other=0.0).to(tl.float32)


@triton.jit
def _block_qkg(q_ptr, k_ptr, g_ptr, stride_y, stride_g, t0, t1, I: tl.constexpr, scale,
               BCC: tl.constexpr, K: tl.constexpr):
    """Rows of sub-block I: normalized q (scaled) and k, gcum, row mask, row indices."""
    rows = (t0 + I * BCC + tl.arange(0, BCC)).to(tl.int64)
    m = rows < t1
    qn = l2_normalize_rows(_load_rows(q_ptr, rows, m, stride_y, K)) * scale
    kn = l2_normalize_rows(_load_rows(k_ptr, rows, m, stride_y, K))
    g = _load_rows(g_ptr, rows, m, stride_g, K)
    return qn, kn, g, m, rows


@triton.jit
def _block_kg(k_ptr, g_ptr, stride_y, stride_g, t0, t1, I: tl.constexpr, BCC: tl.constexpr, K: tl.constexpr):
    """Normalized k and gcum of an earlier sub-block (the column side of off-diagonal blocks)."""
    rows = (t0 + I * BCC + tl.arange(0, BCC)).to(tl.int64)
    m = rows < t1
    return l2_normalize_rows(_load_rows(k_ptr, rows, m, stride_y, K)), _load_rows(g_ptr, rows, m, stride_g, K)


@triton.jit
def _anchor(g_ptr, stride_g, t0, t1, I: tl.constexpr, BCC: tl.constexpr, K: tl.constexpr):
    """gcum at sub-block I's first token (0 when the block is empty: then nothing uses it)."""
    r = (t0 + I * BCC).to(tl.int64)
    return tl.load(g_ptr + r * stride_g + tl.arange(0, K), mask=(r < t1) & (tl.arange(0, K) < K), other=0.0)


@triton.jit
def _offdiag(qn_i, kn_i, g_i, m_i, a_i, kn_j, g_j, PREC: tl.constexpr):
    """(A, Aqk) block of row block I and an earlier column block J, anchored at a_i."""
    up = tl.where(m_i[:, None], tl.exp2(tl.minimum(g_i - a_i[None, :], 0.0)), 0.0)
    # a_i <= g_j on every valid row of J (earlier tokens, cumsum non-increasing): exponent <= 0;
    # the minimum only guards empty row blocks whose anchor reads as 0.
    right = tl.trans(kn_j * tl.exp2(tl.minimum(a_i[None, :] - g_j, 0.0)))
    Akk = tl.dot(kn_i * up, right, input_precision=PREC)
    Aqk = tl.dot(qn_i * up, right, input_precision=PREC)
    return Akk, Aqk


@triton.jit
def _diag_anchored(qn, kn, g, m, a, PREC: tl.constexpr):
    """Diagonal (A, Aqk) block for the bounded gate: factors within 2^[-108, 108] at LB >= -5."""
    # Valid rows: g <= a (later tokens), so the minimum is exact; it keeps masked rows finite.
    up = tl.where(m[:, None], tl.exp2(tl.minimum(g - a[None, :], 0.0)), 0.0)
    down = tl.where(m[:, None], tl.exp2(a[None, :] - g), 0.0)
    right = tl.trans(kn * down)
    return tl.dot(kn * up, right, input_precision=PREC), tl.dot(qn * up, right, input_precision=PREC)


@triton.jit
def _diag_exact(qn, kn, g, m, k_ptr, g_ptr, stride_y, stride_g, row0, t1,
                BCC: tl.constexpr, K: tl.constexpr):
    """Diagonal (A, Aqk) block, any gate: column by column with exponents g_t - g_i <= 0."""
    r = tl.arange(0, BCC)
    cols = tl.arange(0, K)
    Akk = tl.zeros([BCC, BCC], dtype=tl.float32)
    Aqk = tl.zeros([BCC, BCC], dtype=tl.float32)
    for c in range(BCC):
        rc = (row0 + c).to(tl.int64)
        valid = rc < t1
        kc = tl.load(k_ptr + rc * stride_y + cols, mask=valid & (cols < K), other=0.0).to(tl.float32)
        kc = kc * tl.rsqrt(tl.sum(kc * kc, axis=0) + 1e-6)
        gc = tl.load(g_ptr + rc * stride_g + cols, mask=valid & (cols < K), other=0.0)
        decay = tl.where((r >= c)[:, None] & m[:, None], tl.exp2(tl.minimum(g - gc[None, :], 0.0)), 0.0)
        kd = kc[None, :] * decay
        Akk = tl.where(r[None, :] == c, tl.sum(kn * kd, axis=1)[:, None], Akk)
        Aqk = tl.where(r[None, :] == c, tl.sum(qn * kd, axis=1)[:, None], Aqk)
    return Akk, Aqk


@triton.jit
def _diag_block(qn, kn, g, m, a, k_ptr, g_ptr, stride_y, stride_g, row0, t1, beta,
                BCC: tl.constexpr, K: tl.constexpr, EXACT_DIAG: tl.constexpr, PREC: tl.constexpr):
    if EXACT_DIAG:
        Akk, Aqk = _diag_exact(qn, kn, g, m, k_ptr, g_ptr, stride_y, stride_g, row0, t1, BCC, K)
    else:
        Akk, Aqk = _diag_anchored(qn, kn, g, m, a, PREC)
    r = tl.arange(0, BCC)
    Akk = tl.where(r[:, None] > r[None, :], Akk * beta[:, None], 0.0)
    Aqk = tl.where(r[:, None] >= r[None, :], Aqk, 0.0)
    return Akk, Aqk


@triton.jit
def _unit_lower_inverse4(diag_ptr, stride_d, t0, t1, BCC: tl.constexpr, COL_STEP: tl.constexpr):
    """(I + L)^-1 of the four strictly lower diagonal 16x16 blocks stored at diag_ptr, in fp32
    (block I's columns start at I * COL_STEP: 0 in the diagonal-block scratch, BC in all of A).

    Forward substitution, written for the transpose Z = X^T so that each step is a product along
    the rows of Z (a reduction inside a warp, no CTA barrier): with l = L[i, :] read from memory,
    column i of Z is e_i - Z l (only the finished columns j < i meet l's nonzeros). The four
    chains are independent and interleaved for instruction-level parallelism."""
    r = tl.arange(0, BCC)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    Z0, Z1, Z2, Z3 = eye, eye, eye, eye
    for i in range(1, BCC):
        sel = r[None, :] == i
        e_i = (r == i).to(tl.float32)
        row = (t0 + i + r * 0).to(tl.int64)
        l0 = tl.load(diag_ptr + row * stride_d + r, mask=row < t1, other=0.0)
        l1 = tl.load(diag_ptr + (row + BCC) * stride_d + COL_STEP + r, mask=row + BCC < t1, other=0.0)
        l2 = tl.load(diag_ptr + (row + 2 * BCC) * stride_d + 2 * COL_STEP + r, mask=row + 2 * BCC < t1, other=0.0)
        l3 = tl.load(diag_ptr + (row + 3 * BCC) * stride_d + 3 * COL_STEP + r, mask=row + 3 * BCC < t1, other=0.0)
        Z0 = tl.where(sel, (e_i - tl.sum(Z0 * l0[None, :], axis=1))[:, None], Z0)
        Z1 = tl.where(sel, (e_i - tl.sum(Z1 * l1[None, :], axis=1))[:, None], Z1)
        Z2 = tl.where(sel, (e_i - tl.sum(Z2 * l2[None, :], axis=1))[:, None], Z2)
        Z3 = tl.where(sel, (e_i - tl.sum(Z3 * l3[None, :], axis=1))[:, None], Z3)
    return tl.trans(Z0), tl.trans(Z1), tl.trans(Z2), tl.trans(Z3)


@triton.jit
def _wide_row_block(qn, kn, g, m, rows, beta, a, k_ptr, g_ptr, stride_y, stride_g, t0, t1, I: tl.constexpr,
                    aqk_ptr, stride_a, akk_ptr, stride_s, BCC: tl.constexpr, NJ: tl.constexpr, K: tl.constexpr,
                    EXACT_DIAG: tl.constexpr, PREC: tl.constexpr):
    """Row block I of A and Aqk against the chunk's first NJ >= 16 (I + 1) tokens, each in ONE
    [16, K] x [K, NJ] dot: the warps split the NJ columns instead of all repeating one 16-column
    product per earlier block. Anchor a = g at block I's first token (as _offdiag and
    _diag_anchored, the same factors): the left exponent g_t - a <= 0; the right one a - g_i is
    <= 0 for earlier blocks and in [0, 108] on block I's own columns with the bounded gate. Columns
    after block I are discarded; their exponent is clamped at 112 so that, with unit-norm rows,
    every sum stays below 2^119 and nothing non-finite is formed. The unbounded gate's diagonal
    block comes from the exact column loop instead. Stores the rows' Aqk (fp16) and beta-scaled,
    strictly lower A (the fp32 scratch that the inverse reads back)."""
    cr = (t0 + tl.arange(0, NJ)).to(tl.int64)
    mc = cr < t1
    kc = l2_normalize_rows(_load_rows(k_ptr, cr, mc, stride_y, K))
    gc = _load_rows(g_ptr, cr, mc, stride_g, K)
    up = tl.where(m[:, None], tl.exp2(tl.minimum(g - a[None, :], 0.0)), 0.0)
    right = tl.trans(kc * tl.exp2(tl.minimum(a[None, :] - gc, 112.0)))
    Akk = tl.dot(kn * up, right, input_precision=PREC)
    Aqk = tl.dot(qn * up, right, input_precision=PREC)
    ri = I * BCC + tl.arange(0, BCC)[:, None]  # row and column indices inside the chunk
    ci = tl.arange(0, NJ)[None, :]
    Akk = tl.where(ci < ri, Akk * beta[:, None], 0.0)
    Aqk = tl.where(ci <= ri, Aqk, 0.0)
    if EXACT_DIAG:
        written = m[:, None] & (ci < I * BCC)
        Ad, Qd = _diag_block(qn, kn, g, m, a, k_ptr, g_ptr, stride_y, stride_g, t0 + I * BCC, t1, beta, BCC, K, True,
                             PREC)
        _store_block(aqk_ptr, Qd, rows, m, I * BCC, stride_a, BCC)
        _store_block(akk_ptr, Ad, rows, m, I * BCC, stride_s, BCC)
    else:
        written = m[:, None] & (ci < (I + 1) * BCC)
    tl.store(aqk_ptr + rows[:, None] * stride_a + ci, Aqk.to(aqk_ptr.dtype.element_ty), mask=written)
    tl.store(akk_ptr + rows[:, None] * stride_s + ci, Akk, mask=written)


@triton.jit
def _load_block(ptr, t0, t1, I: tl.constexpr, J: tl.constexpr, stride_s, BCC: tl.constexpr):
    """Block (I, J) of the fp32 A scratch (rows past the sequence read as 0)."""
    rows = (t0 + I * BCC + tl.arange(0, BCC)).to(tl.int64)
    cols = J * BCC + tl.arange(0, BCC)
    return tl.load(ptr + rows[:, None] * stride_s + cols[None, :], mask=(rows < t1)[:, None], other=0.0)


@triton.jit
def _store_block(ptr, x, rows, m, col0, stride_t, BCC: tl.constexpr):
    cols = col0 + tl.arange(0, BCC)
    tl.store(ptr + rows[:, None] * stride_t + cols[None, :], x.to(ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def _row_block(q_ptr, k_ptr, g_ptr, beta_ptr, stride_y, stride_g, stride_b, t0, t1, I: tl.constexpr, scale,
               g_last, qg_ptr, kg_ptr, stride_o, BCC: tl.constexpr, K: tl.constexpr):
    """Loads sub-block I (normalized q, k; gcum; beta), stores its qg and kg rows."""
    qn, kn, g, m, rows = _block_qkg(q_ptr, k_ptr, g_ptr, stride_y, stride_g, t0, t1, I, scale, BCC, K)
    beta = tl.sigmoid(tl.load(beta_ptr + rows * stride_b, mask=m, other=0.0).to(tl.float32))
    cols = tl.arange(0, K)
    offs = rows[:, None] * stride_o + cols[None, :]
    tl.store(qg_ptr + offs, (qn * tl.exp2(g)).to(qg_ptr.dtype.element_ty), mask=m[:, None])
    # g_last - g <= 0 on valid rows (masked rows are neither used nor stored).
    tl.store(kg_ptr + offs, (kn * tl.exp2(tl.minimum(g_last[None, :] - g, 0.0))).to(kg_ptr.dtype.element_ty),
             mask=m[:, None])
    return qn, kn, g, m, rows, beta


@triton.jit
def _wu_inputs(k_ptr, v_ptr, g_ptr, stride_y, stride_g, t0, t1, J: tl.constexpr, beta,
               BCC: tl.constexpr, K: tl.constexpr):
    """Right-hand sides of sub-block J: beta k 2^g (for w) and beta v (for u), fp32."""
    rows = (t0 + J * BCC + tl.arange(0, BCC)).to(tl.int64)
    m = rows < t1
    kn = l2_normalize_rows(_load_rows(k_ptr, rows, m, stride_y, K))
    g = _load_rows(g_ptr, rows, m, stride_g, K)
    v = _load_rows(v_ptr, rows, m, stride_y, K)
    return kn * (beta[:, None] * tl.exp2(g)), v * beta[:, None]


@triton.jit
def chunk_intra_kernel(
    y, stride_y, beta_logits, stride_b_t, stride_b_h,
    gcum, chunks, state_indices,
    Aqk, akk_scratch, w, u, kg, qg,
    scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BCC: tl.constexpr,
    EXACT_DIAG: tl.constexpr, PREC: tl.constexpr, BLOCKED_INV: tl.constexpr, INV_PREC: tl.constexpr,
    WIDE: tl.constexpr,
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
    stride_a = H * BT  # row stride of Aqk [T, H, BT]
    Aqk_h = Aqk + i_h * BT
    # fp32 scratch of A: all of it [T, H, BT] (WIDE) or its diagonal blocks [T, H, BC]
    SW: tl.constexpr = BT if WIDE else BCC
    diag_h = akk_scratch + i_h * SW
    stride_d = H * SW
    w_h, u_h, kg_h, qg_h = w + i_h * K, u + i_h * K, kg + i_h * K, qg + i_h * K
    last = tl.minimum(t0 + BT, t1).to(tl.int64) - 1
    g_last = tl.load(g_ptr + last * stride_g + tl.arange(0, K))

    # ---- A and Aqk, sub-block by sub-block (earlier tiles re-read from L1/L2 to bound registers) ----
    qn0, kn0, g0, m0, r0, b0 = _row_block(q_ptr, k_ptr, g_ptr, b_ptr, stride_y, stride_g, stride_b_t, t0, t1, 0, scale,
                                          g_last, qg_h, kg_h, stride_g, BCC, K)
    a0 = _anchor(g_ptr, stride_g, t0, t1, 0, BCC, K)
    if WIDE:
        _wide_row_block(qn0, kn0, g0, m0, r0, b0, a0, k_ptr, g_ptr, stride_y, stride_g, t0, t1, 0, Aqk_h, stride_a,
                        diag_h, stride_d, BCC, BCC, K, EXACT_DIAG, PREC)
    else:
        A00, Q00 = _diag_block(qn0, kn0, g0, m0, a0, k_ptr, g_ptr, stride_y, stride_g, t0, t1, b0, BCC, K, EXACT_DIAG,
                               PREC)
        _store_block(Aqk_h, Q00, r0, m0, 0, stride_a, BCC)
        if BLOCKED_INV:
            X00 = unit_lower_inverse(A00, BCC, 4, INV_PREC)  # 4 = log2(BC)
        else:
            _store_block(diag_h, A00, r0, m0, 0, stride_d, BCC)

    qn1, kn1, g1, m1, r1, b1 = _row_block(q_ptr, k_ptr, g_ptr, b_ptr, stride_y, stride_g, stride_b_t, t0, t1, 1, scale,
                                          g_last, qg_h, kg_h, stride_g, BCC, K)
    a1 = _anchor(g_ptr, stride_g, t0, t1, 1, BCC, K)
    if WIDE:
        _wide_row_block(qn1, kn1, g1, m1, r1, b1, a1, k_ptr, g_ptr, stride_y, stride_g, t0, t1, 1, Aqk_h, stride_a,
                        diag_h, stride_d, BCC, 2 * BCC, K, EXACT_DIAG, PREC)
    else:
        A11, Q11 = _diag_block(qn1, kn1, g1, m1, a1, k_ptr, g_ptr, stride_y, stride_g, t0 + BCC, t1, b1, BCC, K,
                               EXACT_DIAG, PREC)
        kn0, g0 = _block_kg(k_ptr, g_ptr, stride_y, stride_g, t0, t1, 0, BCC, K)
        A10, Q10 = _offdiag(qn1, kn1, g1, m1, a1, kn0, g0, PREC)
        A10 = A10 * b1[:, None]
        _store_block(Aqk_h, Q10, r1, m1, 0, stride_a, BCC)
        _store_block(Aqk_h, Q11, r1, m1, BCC, stride_a, BCC)
        if BLOCKED_INV:
            X11 = unit_lower_inverse(A11, BCC, 4, INV_PREC)  # 4 = log2(BC)
        else:
            _store_block(diag_h, A11, r1, m1, 0, stride_d, BCC)

    qn2, kn2, g2, m2, r2, b2 = _row_block(q_ptr, k_ptr, g_ptr, b_ptr, stride_y, stride_g, stride_b_t, t0, t1, 2, scale,
                                          g_last, qg_h, kg_h, stride_g, BCC, K)
    a2 = _anchor(g_ptr, stride_g, t0, t1, 2, BCC, K)
    if WIDE:
        _wide_row_block(qn2, kn2, g2, m2, r2, b2, a2, k_ptr, g_ptr, stride_y, stride_g, t0, t1, 2, Aqk_h, stride_a,
                        diag_h, stride_d, BCC, BT, K, EXACT_DIAG, PREC)
    else:
        A22, Q22 = _diag_block(qn2, kn2, g2, m2, a2, k_ptr, g_ptr, stride_y, stride_g, t0 + 2 * BCC, t1, b2, BCC, K,
                               EXACT_DIAG, PREC)
        kn0, g0 = _block_kg(k_ptr, g_ptr, stride_y, stride_g, t0, t1, 0, BCC, K)
        A20, Q20 = _offdiag(qn2, kn2, g2, m2, a2, kn0, g0, PREC)
        kn1, g1 = _block_kg(k_ptr, g_ptr, stride_y, stride_g, t0, t1, 1, BCC, K)
        A21, Q21 = _offdiag(qn2, kn2, g2, m2, a2, kn1, g1, PREC)
        A20 = A20 * b2[:, None]
        A21 = A21 * b2[:, None]
        _store_block(Aqk_h, Q20, r2, m2, 0, stride_a, BCC)
        _store_block(Aqk_h, Q21, r2, m2, BCC, stride_a, BCC)
        _store_block(Aqk_h, Q22, r2, m2, 2 * BCC, stride_a, BCC)
        if BLOCKED_INV:
            X22 = unit_lower_inverse(A22, BCC, 4, INV_PREC)  # 4 = log2(BC)
        else:
            _store_block(diag_h, A22, r2, m2, 0, stride_d, BCC)

    qn3, kn3, g3, m3, r3, b3 = _row_block(q_ptr, k_ptr, g_ptr, b_ptr, stride_y, stride_g, stride_b_t, t0, t1, 3, scale,
                                          g_last, qg_h, kg_h, stride_g, BCC, K)
    a3 = _anchor(g_ptr, stride_g, t0, t1, 3, BCC, K)
    if WIDE:
        _wide_row_block(qn3, kn3, g3, m3, r3, b3, a3, k_ptr, g_ptr, stride_y, stride_g, t0, t1, 3, Aqk_h, stride_a,
                        diag_h, stride_d, BCC, BT, K, EXACT_DIAG, PREC)
    else:
        A33, Q33 = _diag_block(qn3, kn3, g3, m3, a3, k_ptr, g_ptr, stride_y, stride_g, t0 + 3 * BCC, t1, b3, BCC, K,
                               EXACT_DIAG, PREC)
        kn0, g0 = _block_kg(k_ptr, g_ptr, stride_y, stride_g, t0, t1, 0, BCC, K)
        A30, Q30 = _offdiag(qn3, kn3, g3, m3, a3, kn0, g0, PREC)
        kn1, g1 = _block_kg(k_ptr, g_ptr, stride_y, stride_g, t0, t1, 1, BCC, K)
        A31, Q31 = _offdiag(qn3, kn3, g3, m3, a3, kn1, g1, PREC)
        kn2, g2 = _block_kg(k_ptr, g_ptr, stride_y, stride_g, t0, t1, 2, BCC, K)
        A32, Q32 = _offdiag(qn3, kn3, g3, m3, a3, kn2, g2, PREC)
        A30 = A30 * b3[:, None]
        A31 = A31 * b3[:, None]
        A32 = A32 * b3[:, None]
        _store_block(Aqk_h, Q30, r3, m3, 0, stride_a, BCC)
        _store_block(Aqk_h, Q31, r3, m3, BCC, stride_a, BCC)
        _store_block(Aqk_h, Q32, r3, m3, 2 * BCC, stride_a, BCC)
        _store_block(Aqk_h, Q33, r3, m3, 3 * BCC, stride_a, BCC)
        if BLOCKED_INV:
            X33 = unit_lower_inverse(A33, BCC, 4, INV_PREC)  # 4 = log2(BC)
        else:
            _store_block(diag_h, A33, r3, m3, 0, stride_d, BCC)

    # ---- X = (I + A)^-1: diagonal blocks (above, or from the scratch here), then the blocks below ----
    if WIDE:
        # A went to the scratch from other threads of this program: a CTA barrier orders those
        # global stores before these loads (L1 hits).
        tl.debug_barrier()
        A10 = _load_block(diag_h, t0, t1, 1, 0, stride_d, BCC)
        A20 = _load_block(diag_h, t0, t1, 2, 0, stride_d, BCC)
        A21 = _load_block(diag_h, t0, t1, 2, 1, stride_d, BCC)
        A30 = _load_block(diag_h, t0, t1, 3, 0, stride_d, BCC)
        A31 = _load_block(diag_h, t0, t1, 3, 1, stride_d, BCC)
        A32 = _load_block(diag_h, t0, t1, 3, 2, stride_d, BCC)
        if BLOCKED_INV:
            X00 = unit_lower_inverse(_load_block(diag_h, t0, t1, 0, 0, stride_d, BCC), BCC, 4, INV_PREC)
            X11 = unit_lower_inverse(_load_block(diag_h, t0, t1, 1, 1, stride_d, BCC), BCC, 4, INV_PREC)
            X22 = unit_lower_inverse(_load_block(diag_h, t0, t1, 2, 2, stride_d, BCC), BCC, 4, INV_PREC)
            X33 = unit_lower_inverse(_load_block(diag_h, t0, t1, 3, 3, stride_d, BCC), BCC, 4, INV_PREC)
        else:
            X00, X11, X22, X33 = _unit_lower_inverse4(diag_h, stride_d, t0, t1, BCC, BCC)
    elif not BLOCKED_INV:
        # The substitution reads rows of the diagonal blocks stored above by other threads of this
        # program: a CTA barrier orders those global stores before the loads.
        tl.debug_barrier()
        X00, X11, X22, X33 = _unit_lower_inverse4(diag_h, stride_d, t0, t1, BCC, 0)
    # X_IJ = -X_II sum_{J <= M < I} A_IM X_MJ
    X10 = -tl.dot(X11, tl.dot(A10, X00, input_precision=INV_PREC), input_precision=INV_PREC)
    X21 = -tl.dot(X22, tl.dot(A21, X11, input_precision=INV_PREC), input_precision=INV_PREC)
    X20 = -tl.dot(X22, tl.dot(A20, X00, input_precision=INV_PREC) + tl.dot(A21, X10, input_precision=INV_PREC),
                  input_precision=INV_PREC)
    X32 = -tl.dot(X33, tl.dot(A32, X22, input_precision=INV_PREC), input_precision=INV_PREC)
    X31 = -tl.dot(X33, tl.dot(A31, X11, input_precision=INV_PREC) + tl.dot(A32, X21, input_precision=INV_PREC),
                  input_precision=INV_PREC)
    X30 = -tl.dot(X33, tl.dot(A30, X00, input_precision=INV_PREC) + tl.dot(A31, X10, input_precision=INV_PREC)
                  + tl.dot(A32, X20, input_precision=INV_PREC), input_precision=INV_PREC)

    # ---- w = X (beta k 2^g), u = X (beta v), column block J by column block J: each right-hand
    # side is formed once and every row block I >= J accumulates it; row block J is then complete.
    xw, xu = _wu_inputs(k_ptr, v_ptr, g_ptr, stride_y, stride_g, t0, t1, 0, b0, BCC, K)
    W0 = tl.dot(X00, xw, input_precision=PREC)
    U0 = tl.dot(X00, xu, input_precision=PREC)
    W1 = tl.dot(X10, xw, input_precision=PREC)
    U1 = tl.dot(X10, xu, input_precision=PREC)
    W2 = tl.dot(X20, xw, input_precision=PREC)
    U2 = tl.dot(X20, xu, input_precision=PREC)
    W3 = tl.dot(X30, xw, input_precision=PREC)
    U3 = tl.dot(X30, xu, input_precision=PREC)
    _store_block(w_h, W0, r0, m0, 0, stride_g, K)
    _store_block(u_h, U0, r0, m0, 0, stride_g, K)

    xw, xu = _wu_inputs(k_ptr, v_ptr, g_ptr, stride_y, stride_g, t0, t1, 1, b1, BCC, K)
    W1 = tl.dot(X11, xw, acc=W1, input_precision=PREC)
    U1 = tl.dot(X11, xu, acc=U1, input_precision=PREC)
    W2 = tl.dot(X21, xw, acc=W2, input_precision=PREC)
    U2 = tl.dot(X21, xu, acc=U2, input_precision=PREC)
    W3 = tl.dot(X31, xw, acc=W3, input_precision=PREC)
    U3 = tl.dot(X31, xu, acc=U3, input_precision=PREC)
    _store_block(w_h, W1, r1, m1, 0, stride_g, K)
    _store_block(u_h, U1, r1, m1, 0, stride_g, K)

    xw, xu = _wu_inputs(k_ptr, v_ptr, g_ptr, stride_y, stride_g, t0, t1, 2, b2, BCC, K)
    W2 = tl.dot(X22, xw, acc=W2, input_precision=PREC)
    U2 = tl.dot(X22, xu, acc=U2, input_precision=PREC)
    W3 = tl.dot(X32, xw, acc=W3, input_precision=PREC)
    U3 = tl.dot(X32, xu, acc=U3, input_precision=PREC)
    _store_block(w_h, W2, r2, m2, 0, stride_g, K)
    _store_block(u_h, U2, r2, m2, 0, stride_g, K)

    xw, xu = _wu_inputs(k_ptr, v_ptr, g_ptr, stride_y, stride_g, t0, t1, 3, b3, BCC, K)
    W3 = tl.dot(X33, xw, acc=W3, input_precision=PREC)
    U3 = tl.dot(X33, xu, acc=U3, input_precision=PREC)
    _store_block(w_h, W3, r3, m3, 0, stride_g, K)
    _store_block(u_h, U3, r3, m3, 0, stride_g, K)


def launch_intra(y, beta_logits, gcum, tables, state_indices, Aqk, akk_scratch, w, u, kg, qg, *,
                 exact_diag: bool, precision: str, BT: int, num_warps: int = 8, blocked_inverse: bool = True,
                 inverse_precision: str = "ieee", maxnreg: int | None = None, wide: bool = True) -> None:
    """maxnreg caps registers per thread so that more programs share an SM (ptxas spills the rest).
    wide: A by row blocks against all earlier columns at once (akk_scratch [T, H, BT]), else one
    dot per block pair (akk_scratch [T, H, BC]); ChunkPlan decides (ChunkConfig.intra_wide)."""
    if akk_scratch.shape[-1] != (BT if wide else BC):
        raise ValueError(f"akk_scratch must be [T, H, {BT if wide else BC}] for wide={wide}, got {tuple(akk_scratch.shape)}")
    T, H, K = gcum.shape
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    chunk_intra_kernel[(tables.num_chunks * H,)](
        y, y.stride(0), beta_logits, beta_logits.stride(0), beta_logits.stride(1),
        gcum, tables.chunks, state_indices,
        Aqk, akk_scratch, w, u, kg, qg,
        K ** -0.5,
        H=H, K=K, BT=BT, BCC=BC, EXACT_DIAG=exact_diag, PREC=precision,
        BLOCKED_INV=blocked_inverse, INV_PREC=inverse_precision, WIDE=wide, num_warps=num_warps, **extra,
    )
