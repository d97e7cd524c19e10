"""Triton kernel of the KDA recurrence for decode (1 token per sequence) and speculative verify.

One program per (sequence, head, V-tile), flattened on grid axis x (axis z caps at 65,535). The
program holds a [BV, K] tile of the fp32 state in registers for all of the sequence's tokens, so
the state crosses HBM exactly twice per step (read once, written once per token slot). K is the
contiguous dim of the pool: a row of K is one vector load (16-byte accesses). q, k, forget_logits are loaded
whole (K) by each V-tile program and l2norm, gate and beta are recomputed there: a few hundred
flops against the 16 KB state tile each program streams, cheaper than another launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.triton_math import l2_normalize, log_decay


@triton.jit
def kda_recurrent_kernel(
    y_ptr, stride_y_t,
    g_ptr, stride_g_t, stride_g_h,
    b_ptr, stride_b_t, stride_b_h,
    s_ptr, stride_s_slot, stride_s_h, stride_s_v,
    o_ptr, stride_o_t, stride_o_h,
    a_log_ptr, dt_bias_ptr,
    idx_ptr, spec_ptr, stride_spec_n, acc_ptr,
    H, lower_bound, scale,
    M: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    IS_SPEC: tl.constexpr, BOUNDED: tl.constexpr, GATE_DT: tl.constexpr = tl.float32,
):
    pid = tl.program_id(0)
    NV: tl.constexpr = V // BV
    iv = pid % NV
    nh = pid // NV
    h = nh % H
    n = nh // H
    if IS_SPEC:
        first = tl.load(spec_ptr + n.to(tl.int64) * stride_spec_n)
        if first <= 0:
            return
        # Clamped to [1, M] like the fused kernel: a count out of range never reads outside the row.
        accepted = tl.minimum(tl.maximum(tl.load(acc_ptr + n).to(tl.int32), 1), M)
        src = tl.load(spec_ptr + n.to(tl.int64) * stride_spec_n + accepted - 1).to(tl.int64)
    else:
        src = tl.load(idx_ptr + n).to(tl.int64)
        if src <= 0:
            return

    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    tile = h * stride_s_h + offs_v[:, None] * stride_s_v + offs_k[None, :]
    S = tl.load(s_ptr + src * stride_s_slot + tile).to(tl.float32)

    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h * K + offs_k).to(tl.float32)
    P = H * K
    for j in tl.static_range(M):  # M = 1 or S+1: unrolled, few values, one compile each
        t = n.to(tl.int64) * M + j
        row = y_ptr + t * stride_y_t
        q = tl.load(row + h * K + offs_k).to(tl.float32)
        k = tl.load(row + P + h * K + offs_k).to(tl.float32)
        v = tl.load(row + 2 * P + h * V + offs_v).to(tl.float32)
        q = l2_normalize(q, scale)
        k = l2_normalize(k, 1.0)
        x = tl.load(g_ptr + t * stride_g_t + h * stride_g_h + offs_k).to(tl.float32) + dt_bias
        gk = log_decay(x, a, lower_bound, BOUNDED)
        gk = gk.to(GATE_DT).to(tl.float32)   # Ling-3's rounding (KDAWeights.gate_dtype); fp32: none
        beta = tl.sigmoid(tl.load(b_ptr + t * stride_b_t + h * stride_b_h).to(tl.float32))

        S = S * tl.exp(gk)[None, :]
        u = beta * (v - tl.sum(S * k[None, :], axis=1))
        S = S + u[:, None] * k[None, :]
        o = tl.sum(S * q[None, :], axis=1)
        tl.store(o_ptr + t * stride_o_t + h * stride_o_h + offs_v, o.to(o_ptr.dtype.element_ty))
        if IS_SPEC:
            dst = tl.load(spec_ptr + n.to(tl.int64) * stride_spec_n + j).to(tl.int64)
            if dst > 0:
                tl.store(s_ptr + dst * stride_s_slot + tile, S.to(s_ptr.dtype.element_ty))
    if not IS_SPEC:
        tl.store(s_ptr + src * stride_s_slot + tile, S.to(s_ptr.dtype.element_ty))
