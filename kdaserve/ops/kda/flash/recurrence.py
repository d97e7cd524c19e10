"""K2, the serial pass over chunks: the fp32 state lives in registers for a whole segment.

Per chunk of C tokens (state S [BV, K], V-major like the pool; rows of W, Qg, Kd per token):

    U^T = U~^T - S W^T            the corrected values u_t, one [BV, K] x [K, C] dot
    O^T = S Qg^T + U^T Aqk^T      outputs of the chunk's tokens
    S   = S * gam + U^T Kd        state at the chunk's end

The rows of S are the M side of every dot (BV = 64..128 rows feed Hopper's warpgroup MMA), S is
rounded to the workspace dtype (fp16) only as a dot operand while the state itself accumulates in
fp32, and the chunk decay gam is applied in fp32.

Two uses:
- SEGMENTED=False: one program per (segment = whole sequence, head) with BV = V, the gated
  RMSNorm fused into the output (it needs all of V), final state into the pool, and the sequence's
  conv-state rows rewritten (safe here: K1, which read the old rows, has finished).
- SEGMENTED=True (the map pass of sequence parallelism): programs per (segment, head, part,
  V-slice). part 0 runs the segment from zero (from the pool for a sequence's first segment) and
  writes unnormalized outputs o_loc and its end state B; part 1 runs the same chunks from the
  identity with v = 0, which yields the segment's transition M (S_end = S_start M + B) and
  q~_t = M_t q_t (o_t = o_loc_t + S_start q~_t). o_loc and q~ go to the 16-bit workspace, B and
  M to fp32, for scan.py and correct.py.

State checkpoints (prefix caching, NCK > 0): sequence n asks for copies of its state and conv window at chunk
ends `ck_off[n, :]` tokens into its new tokens, into slots `ck_slot[n, :]` (offset -1: none). At such a chunk
end a program stores the state where it holds the true one: always unsegmented, in a sequence's first segment
when segmented. Inside a later segment both parts store what they hold there (B_o and M_o, fp32, in `ck_maps[n
* NCK + j]`), and the scan, which knows the segment's start, writes S_start M_o + B_o; at a segment start it
writes the start itself. So the segments never depend on where checkpoints fall, and a step's outputs are the
same with or without them. The chunk loop runs in pieces that end at the checkpoints, so that the stores sit
between pieces, not in the loop. After its chunk loop the program whose segment holds a checkpoint writes its
conv rows: the raw tokens before it, all in this step (offsets are at least C, the conv rows at most C: the
wrapper checks).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.kda.flash.output_norm import store_gated_norm


@triton.jit
def write_conv_state(
    qkv_ptr, stride_qkv, cs_ptr, stride_cs_row, stride_cs_ch,
    ch0, seq_start, seq_len, init, L,
    D: tl.constexpr, L_PAD: tl.constexpr,
):
    """New conv-state rows of D channels starting at ch0 (for q, k and v): the last L rows of
    history ++ new tokens. All old rows are read before any is written (a barrier between), since
    a short sequence shifts its history inside the same rows."""
    r = tl.arange(0, L_PAD)
    cols = tl.arange(0, D)
    idx = seq_len - L + r
    from_x = idx >= 0
    rmask = (r < L)[:, None]
    P3 = ch0 + cols  # q channels; k and v are +P, +2P away (passed through ch0 by the caller)
    x_rows = (seq_start + idx).to(tl.int64)[:, None] * stride_qkv
    h_rows = (L + idx)[:, None] * stride_cs_row
    m_x = rmask & from_x[:, None]
    m_h = rmask & (idx < 0)[:, None] & init
    xq = tl.load(qkv_ptr + x_rows + P3[None, :], mask=m_x, other=0.0)
    hq = tl.load(cs_ptr + h_rows + P3[None, :] * stride_cs_ch, mask=m_h, other=0.0)
    tl.debug_barrier()
    new = tl.where(from_x[:, None], xq.to(cs_ptr.dtype.element_ty), hq)
    tl.store(cs_ptr + r[:, None] * stride_cs_row + P3[None, :] * stride_cs_ch, new, mask=rmask)


@triton.jit
def _chunk(S, chunk, t0, tok1, h, part, rows, kcols, crow,
           w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, oq_ptr, q_off,
           o_ptr, stride_o_t, stride_o_h, stride_o_d,
           out_gate_ptr, stride_out_gate_t, stride_out_gate_h, stride_out_gate_d, nw, eps,
           H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, SEGMENTED: tl.constexpr, PREC: tl.constexpr,
           FAST: tl.constexpr):
    """One chunk (tokens t0.. of workspace chunk `chunk`): its outputs (local and q~, or final and
    normed), and the state after it."""
    blk = chunk * H + h
    base = blk * (C * D)
    wT = tl.load(w_ptr + base + crow[None, :] * D + kcols[:, None])                  # [K, C]
    uT = tl.load(u_ptr + base + crow[None, :] * D + rows[:, None], mask=part == 0, other=0.0)  # [BV, C]
    qT = tl.load(qg_ptr + base + crow[None, :] * D + kcols[:, None])                 # [K, C]
    aT = tl.load(aqk_ptr + blk * (C * C) + crow[None, :] * C + crow[:, None])       # [C(i), C(t)]
    kd = tl.load(kd_ptr + base + crow[:, None] * D + kcols[None, :])                 # [C, K]
    gam = tl.load(gam_ptr + blk * D + kcols)

    dt = w_ptr.dtype.element_ty
    Sh = S.to(dt)
    Ut = uT.to(tl.float32) - tl.dot(Sh, wT, input_precision=PREC)
    Uh = Ut.to(dt)
    Ot = tl.dot(Sh, qT, input_precision=PREC)
    Ot = tl.dot(Uh, aT, acc=Ot, input_precision=PREC)
    S = S * gam[None, :]
    S = tl.dot(Uh, kd, acc=S, input_precision=PREC)

    toks = t0 + crow
    tmask = (toks < tok1)[None, :]
    trow = toks.to(tl.int64)[None, :]
    if SEGMENTED:
        oq = oq_ptr + part * q_off + trow * (H * D) + h * D + rows[:, None]
        tl.store(oq, Ot.to(oq_ptr.dtype.element_ty), mask=tmask)
    else:
        store_gated_norm(Ot, trow, tmask, h, rows, nw, eps, out_gate_ptr, stride_out_gate_t, stride_out_gate_h,
                         stride_out_gate_d, o_ptr, stride_o_t, stride_o_h, stride_o_d, D, FAST)
    return S


@triton.jit
def _checkpoint(S, o, ck, j, n, h, part, first, seg_end, rows, kcols,
                s_ptr, stride_s_slot, stride_s_h, stride_s_v, ck_maps_ptr,
                H: tl.constexpr, D: tl.constexpr, NCK: tl.constexpr, SEGMENTED: tl.constexpr):
    """Checkpoint j (slot ck) at `o` tokens into sequence n: the true state where this program
    holds it, else (inside a later segment) this segment's map up to it, for the scan."""
    if first & (part == 0):
        tl.store(s_ptr + ck * stride_s_slot + h * stride_s_h + rows[:, None] * stride_s_v + kcols[None, :],
                 S.to(s_ptr.dtype.element_ty))
    elif SEGMENTED:
        if o < seg_end:   # a segment's end is the next one's start (the scan writes it)
            tl.store(ck_maps_ptr + ((n.to(tl.int64) * NCK + j) * 2 + part) * (H * D * D) + h * (D * D)
                     + rows[:, None] * D + kcols[None, :], S)


@triton.jit
def flash_recurrence_kernel(
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr,
    s_ptr, stride_s_slot, stride_s_h, stride_s_v,
    o_ptr, stride_o_t, stride_o_h, stride_o_d,
    out_gate_ptr, stride_out_gate_t, stride_out_gate_h, stride_out_gate_d,
    nw_ptr, eps,
    oq_ptr, bm_ptr,
    cu_ptr, idx_ptr, init_ptr,
    seg_seq_ptr, seg_tok_ptr, seg_end_ptr, seg_chunk_ptr,
    qkv_ptr, stride_qkv, cs_ptr, stride_cs_slot, stride_cs_row, stride_cs_ch, L, q_off,
    ck_off_ptr, ck_slot_ptr, ck_maps_ptr,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    SEGMENTED: tl.constexpr, L_PAD: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, NCK: tl.constexpr = 0,
    CK_PIECES: tl.constexpr = True,
):
    pid = tl.program_id(0)
    NV: tl.constexpr = D // BV
    if SEGMENTED:
        vs = pid % NV
        part = (pid // NV) % 2
        h = (pid // (2 * NV)) % H
        s = pid // (2 * NV * H)
    else:
        vs = 0
        part = pid * 0  # a tensor, so the masks below read the same in both modes
        h = pid % H
        s = pid // H
    n = tl.load(seg_seq_ptr + s)
    if n < 0:
        return
    slot = tl.load(idx_ptr + n).to(tl.int64)
    if slot <= 0:
        return
    seq_start = tl.load(cu_ptr + n)
    seq_end = tl.load(cu_ptr + n + 1)
    tok0 = tl.load(seg_tok_ptr + s)
    tok1 = tl.load(seg_end_ptr + s)
    first = tok0 == seq_start
    last = tok1 == seq_end
    if (part == 1) & first:
        return  # a sequence's first segment starts from the known state: no map needed
    init = tl.load(init_ptr + n) != 0

    rows = vs * BV + tl.arange(0, BV)
    kcols = tl.arange(0, D)
    crow = tl.arange(0, C)
    state_tile = s_ptr + slot * stride_s_slot + h * stride_s_h + rows[:, None] * stride_s_v + kcols[None, :]
    S = tl.load(state_tile, mask=first & init & (part == 0), other=0.0).to(tl.float32)
    S = tl.where((rows[:, None] == kcols[None, :]) & (part == 1), 1.0, S)
    if SEGMENTED:
        nw = tl.zeros([BV], tl.float32)   # unused: the output pass norms
    else:
        nw = tl.load(nw_ptr + rows).to(tl.float32)

    chunk0 = tl.load(seg_chunk_ptr + s).to(tl.int64)
    n_chunks = (tok1 - tok0 + C - 1) // C
    if NCK == 0:
        for c in range(n_chunks):
            S = _chunk(S, chunk0 + c, tok0 + c * C, tok1, h, part, rows, kcols, crow,
                       w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, oq_ptr, q_off,
                       o_ptr, stride_o_t, stride_o_h, stride_o_d,
                       out_gate_ptr, stride_out_gate_t, stride_out_gate_h, stride_out_gate_d, nw, eps,
                       H, D, C, SEGMENTED, PREC, FAST)
    elif CK_PIECES:
        # Checkpoints (offsets in increasing order, chunk ends: the wrapper checks): the chunks run
        # in pieces that end at this segment's checkpoints, and a checkpoint's state is stored
        # between pieces, outside the chunk loop. A store inside it made NVIDIA's build convert S's
        # layout in every chunk (more shared memory, spills: compile_check's numbers).
        seg_lo = tok0 - seq_start
        c0 = seg_lo * 0   # chunks done (a tensor: it is carried through the loop)
        for i in range(NCK + 1):   # piece i ends at checkpoint i; the last piece at the segment's end
            live = i < NCK
            o = tl.load(ck_off_ptr + n * NCK + i, mask=live, other=-1)
            ck = tl.load(ck_slot_ptr + n * NCK + i, mask=live, other=0).to(tl.int64)
            takes = (ck > 0) & (o > seg_lo + c0 * C) & (o <= seg_lo + n_chunks * C) & ((o - seg_lo) % C == 0)
            c1 = tl.where(takes, (o - seg_lo) // C, tl.where(live, c0, n_chunks))
            for c in range(c0, c1):   # one chunk loop in the kernel: one set of pipelined buffers
                S = _chunk(S, chunk0 + c, tok0 + c * C, tok1, h, part, rows, kcols, crow,
                           w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, oq_ptr, q_off,
                           o_ptr, stride_o_t, stride_o_h, stride_o_d,
                           out_gate_ptr, stride_out_gate_t, stride_out_gate_h, stride_out_gate_d, nw, eps,
                           H, D, C, SEGMENTED, PREC, FAST)
            c0 = c1
            if takes:
                _checkpoint(S, o, ck, i, n, h, part, first, tok1 - seq_start, rows, kcols,
                            s_ptr, stride_s_slot, stride_s_h, stride_s_v, ck_maps_ptr, H, D, NCK, SEGMENTED)
    else:
        # The same, a chunk at a time with the store inside the loop: on AMD the pieces' build
        # needs more LDS (gfx942's unsegmented variant past its 64 KB) than this one.
        for c in range(n_chunks):
            S = _chunk(S, chunk0 + c, tok0 + c * C, tok1, h, part, rows, kcols, crow,
                       w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gam_ptr, oq_ptr, q_off,
                       o_ptr, stride_o_t, stride_o_h, stride_o_d,
                       out_gate_ptr, stride_out_gate_t, stride_out_gate_h, stride_out_gate_d, nw, eps,
                       H, D, C, SEGMENTED, PREC, FAST)
            end = tok0 - seq_start + c * C + C   # this chunk's end, in tokens into the sequence
            ks = tl.arange(0, NCK)
            hit = tl.load(ck_off_ptr + n * NCK + ks) == end
            ck = tl.sum(tl.where(hit, tl.load(ck_slot_ptr + n * NCK + ks), 0)).to(tl.int64)
            if ck > 0:
                _checkpoint(S, end, ck, tl.sum(tl.where(hit, ks, 0)), n, h, part, first, tok1 - seq_start, rows,
                            kcols, s_ptr, stride_s_slot, stride_s_h, stride_s_v, ck_maps_ptr, H, D, NCK, SEGMENTED)

    if SEGMENTED:
        if last & first:
            tl.store(state_tile, S.to(s_ptr.dtype.element_ty))
        else:
            bm = bm_ptr + ((s.to(tl.int64) * 2 + part) * H + h) * (D * D) + rows[:, None] * D + kcols[None, :]
            tl.store(bm, S)
    else:
        tl.store(state_tile, S.to(s_ptr.dtype.element_ty))
    if (NCK > 0) & (part == 0) & (vs == 0):   # the checkpoints' conv rows: inputs only, outside the chunk loop
        for j in tl.static_range(NCK):
            end = tl.load(ck_off_ptr + n * NCK + j)
            ck = tl.load(ck_slot_ptr + n * NCK + j).to(tl.int64)
            if (ck > 0) & (end > tok0 - seq_start) & (end <= tok1 - seq_start):
                for part_qkv in tl.static_range(3):
                    write_conv_state(qkv_ptr, stride_qkv, cs_ptr + ck * stride_cs_slot, stride_cs_row, stride_cs_ch,
                                     part_qkv * H * D + h * D, seq_start, end, False, L, D, L_PAD)
    if last & (part == 0) & (vs == 0):
        hist = cs_ptr + slot * stride_cs_slot
        P = H * D
        for part_qkv in tl.static_range(3):
            write_conv_state(qkv_ptr, stride_qkv, hist, stride_cs_row, stride_cs_ch, part_qkv * P + h * D,
                             seq_start, seq_end - seq_start, init, L, D, L_PAD)
