"""Stage 4 of chunked prefill: chunk outputs and the gated RMSNorm, written into `out`.

One program per (chunk, head), fully parallel (the serial dependency ended in stage 3):

    o = qg h[c] + Aqk v_new        ([BT, V], fp32 accumulation; h[c] = S^T at the chunk start)
    y = o * rsqrt(mean(o^2) + eps) * w_norm * sigmoid(g2)      (docs/kda-semantics.md section 1.7, fp32)

The norm is fused here because a program already holds whole rows of V = D values: it saves
writing o and reading it back. Rows of sequences whose slot is <= 0 are not written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.triton_math import rms_rstd


@triton.jit
def chunk_output_norm_kernel(
    qg, h_states, Aqk, v_new,
    g2, stride_g2_t, stride_g2_h, stride_g2_d,
    norm_w, eps,
    out, stride_o_t, stride_o_h, stride_o_d,
    chunks, state_indices,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    i_c = pid // H
    i_h = pid % H
    n = tl.load(chunks + i_c * 3)
    if tl.load(state_indices + n) <= 0:
        return
    t0 = tl.load(chunks + i_c * 3 + 1)
    t1 = tl.load(chunks + i_c * 3 + 2)
    rt = tl.arange(0, BT)
    rows = (t0 + rt).to(tl.int64)
    m = rows < t1
    rk = tl.arange(0, K)

    b_qg = tl.load(qg + (rows[:, None] * H + i_h) * K + rk[None, :], mask=m[:, None], other=0.0)
    b_h = tl.load(h_states + (i_c.to(tl.int64) * H + i_h) * (K * K) + rk[:, None] * K + rk[None, :])  # [K, V]
    o = tl.dot(b_qg, b_h, input_precision=PREC)
    causal = m[:, None] & (rt[None, :] <= rt[:, None])
    b_A = tl.load(Aqk + (rows[:, None] * H + i_h) * BT + rt[None, :], mask=causal, other=0.0)
    b_vn = tl.load(v_new + (rows[:, None] * H + i_h) * K + rk[None, :], mask=m[:, None], other=0.0)
    o = tl.dot(b_A, b_vn, acc=o, input_precision=PREC)

    rstd = rms_rstd(tl.sum(o * o, axis=1), eps, K)
    gate = tl.load(g2 + rows[:, None] * stride_g2_t + i_h * stride_g2_h + rk[None, :] * stride_g2_d,
                   mask=m[:, None], other=0.0).to(tl.float32)
    wn = tl.load(norm_w + rk).to(tl.float32)
    y = o * rstd[:, None] * wn[None, :] * tl.sigmoid(gate)
    tl.store(out + rows[:, None] * stride_o_t + i_h * stride_o_h + rk[None, :] * stride_o_d,
             y.to(out.dtype.element_ty), mask=m[:, None])


def launch_output_norm(qg, h_states, Aqk, v_new, g2, norm_weight, eps, out, tables, state_indices, *,
                       BT: int, precision: str, num_warps: int = 4) -> None:
    T, H, K = qg.shape
    g2 = g2.view(T, H, K)
    out = out.view(T, H, K)
    chunk_output_norm_kernel[(tables.num_chunks * H,)](
        qg, h_states, Aqk, v_new,
        g2, *g2.stride(),
        norm_weight, float(eps),
        out, *out.stride(),
        tables.chunks, state_indices,
        H=H, K=K, BT=BT, PREC=precision, num_warps=num_warps,
    )
