"""Stage 1 of chunked prefill: forget gate + chunk-local cumulative sum, in log2 units.

One program per (chunk, head). It reads the gate logits g1 where they lie (any strides), applies
the gate of docs/kda-semantics.md section 1.4 in fp32, and writes

    gcum[t, h, :] = log2(e) * sum_{s = chunk start .. t} gk[s, h, :]      (fp32, [T, H, K])

Why log2 units: every later stage needs exp(g_t - g_i); with g pre-scaled by log2(e) those are
single exp2 instructions. Why fp32: |gcum| reaches 64 * 5 / ln 2 ~ 462 at LB = -5 and the stages
take differences of nearby values; bf16 (8 bits) would put an absolute error of ~2 on them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.triton_math import log_decay

LOG2E = 1.4426950408889634


@triton.jit
def kda_gate(g1, A_log_h, dt_bias_h, lower_bound, BOUNDED: tl.constexpr):
    """gk (fp32) from gate logits g1 [.., K] (fp32) of one head; A_log_h scalar, dt_bias_h [K]."""
    return log_decay(g1 + dt_bias_h[None, :], tl.exp(A_log_h), lower_bound, BOUNDED)


@triton.jit
def chunk_gate_cumsum_kernel(
    g1, stride_g1_t, stride_g1_h, stride_g1_d,
    A_log, dt_bias, lower_bound,
    gcum,
    chunks, state_indices,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BOUNDED: tl.constexpr,
):
    pid = tl.program_id(0)
    i_c = pid // H
    i_h = pid % H
    n = tl.load(chunks + i_c * 3)
    if tl.load(state_indices + n) <= 0:
        return  # null slot: the sequence is skipped by every stage
    t0 = tl.load(chunks + i_c * 3 + 1)
    t1 = tl.load(chunks + i_c * 3 + 2)
    rows = (t0 + tl.arange(0, BT)).to(tl.int64)
    m = rows < t1
    cols = tl.arange(0, K)
    x = tl.load(g1 + rows[:, None] * stride_g1_t + i_h * stride_g1_h + cols[None, :] * stride_g1_d,
                mask=m[:, None], other=0.0).to(tl.float32)
    gk = kda_gate(x, tl.load(A_log + i_h).to(tl.float32), tl.load(dt_bias + i_h * K + cols).to(tl.float32),
                  lower_bound, BOUNDED)
    gk = tl.where(m[:, None], gk, 0.0)
    g = tl.cumsum(gk, axis=0) * 1.4426950408889634
    tl.store(gcum + (rows[:, None] * H + i_h) * K + cols[None, :], g, mask=m[:, None])


def launch_gate_cumsum(g1, weights, gcum, tables, state_indices, BT: int) -> None:
    T, H, K = gcum.shape
    g1 = g1.view(T, H, K)
    bounded = weights.lower_bound is not None
    chunk_gate_cumsum_kernel[(tables.num_chunks * H,)](
        g1, g1.stride(0), g1.stride(1), g1.stride(2),
        weights.A_log, weights.dt_bias, float(weights.lower_bound) if bounded else 0.0,
        gcum, tables.chunks, state_indices,
        H=H, K=K, BT=BT, BOUNDED=bounded, num_warps=4,
    )
