"""Stage 3 of chunked prefill: the serial pass over a sequence's chunks, in place on the pool.

One program per (sequence, head, V-tile), all on grid axis x. The state tile S [BV, K] stays in
fp32 registers for the whole sequence; per chunk (w, u, kg from stage 2):

    h[c]  = S^T                                (stored [K, V] for the output stage, input dtype)
    v_new = u - w S^T                          ([BT, BV], the corrected values)
    S     = S * 2^(g_last) + v_new^T kg        (decay along K, then the chunk's update)

The initial state is read straight from `pool[state_indices[n]]` when has_initial_state[n] (else
zeros) and the final state is written back into the same slot: no gather/scatter copies. Rows whose
slot is <= 0 return before touching anything.

Precision: S accumulates in fp32 across the whole sequence; the products take S and v_new rounded
to the input dtype as tensor-core operands (the rounding is relative, per chunk, not compounded:
the fp32 accumulator is never re-rounded). 2^(g_last) <= 1 cannot overflow; it underflows to 0 only
for a decay below 2^-126 over one chunk, where the true factor is as good as 0.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_state_pass_kernel(
    w, u, kg, gcum, v_new, h_states,
    pool, stride_p_slot, stride_p_h, stride_p_v, stride_p_k,
    cu_seqlens, seq_first_chunk, state_indices, has_initial_state,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    NV: tl.constexpr = K // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_h = (pid // NV) % H
    n = pid // (NV * H)
    slot = tl.load(state_indices + n).to(tl.int64)
    if slot <= 0:
        return
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    c0 = tl.load(seq_first_chunk + n).to(tl.int64)

    rv = i_v * BV + tl.arange(0, BV)
    rk = tl.arange(0, K)
    rt = tl.arange(0, BT)
    # The state is held transposed, St = S^T [K, BV], so that both products have M >= 64 rows
    # (v_new: M = BT, update: M = K) and map onto Hopper's warp-group MMA.
    p_St = pool + slot * stride_p_slot + i_h * stride_p_h + rk[:, None] * stride_p_k + rv[None, :] * stride_p_v
    St = tl.zeros([K, BV], dtype=tl.float32)
    if tl.load(has_initial_state + n):
        St = tl.load(p_St).to(tl.float32)

    DT = w.dtype.element_ty
    num_chunks = ((eos - bos).to(tl.int32) + BT - 1) // BT
    for ic in range(num_chunks):
        t0 = bos + ic * BT
        rows = t0 + rt
        m = rows < eos
        # h[c] in [K, V] layout: the output stage multiplies qg [BT, K] by it directly.
        tl.store(h_states + ((c0 + ic) * H + i_h) * (K * K) + rk[:, None] * K + rv[None, :], St.to(DT))
        b_w = tl.load(w + (rows[:, None] * H + i_h) * K + rk[None, :], mask=m[:, None], other=0.0)
        b_u = tl.load(u + (rows[:, None] * H + i_h) * K + rv[None, :], mask=m[:, None], other=0.0)
        vn = b_u.to(tl.float32) - tl.dot(b_w, St.to(DT), input_precision=PREC)
        vn_q = vn.to(DT)
        tl.store(v_new + (rows[:, None] * H + i_h) * K + rv[None, :], vn_q, mask=m[:, None])
        last = tl.minimum(t0 + BT, eos) - 1
        g_last = tl.load(gcum + (last * H + i_h) * K + rk)
        b_kg = tl.load(kg + (rows[:, None] * H + i_h) * K + rk[None, :], mask=m[:, None], other=0.0)
        St = St * tl.exp2(g_last)[:, None] + tl.dot(tl.trans(b_kg), vn_q, input_precision=PREC)
    tl.store(p_St, St.to(pool.dtype.element_ty))


def launch_state_pass(w, u, kg, gcum, v_new, h_states, pool, cu_seqlens, tables, state_indices,
                      has_initial_state, *, BT: int, BV: int, precision: str, num_warps: int = 4,
                      num_stages: int = 2) -> None:
    T, H, K = gcum.shape
    N = state_indices.shape[0]
    if N == 0:
        return
    chunk_state_pass_kernel[(N * H * (K // BV),)](
        w, u, kg, gcum, v_new, h_states,
        pool, *pool.stride(),
        cu_seqlens, tables.seq_first_chunk, state_indices, has_initial_state,
        H=H, K=K, BT=BT, BV=BV, PREC=precision, num_warps=num_warps, num_stages=num_stages,
    )
