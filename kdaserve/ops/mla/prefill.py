"""Triton MLA prefill: varlen causal attention with scores q_nope·k_nope + q_pe·k_pe, the key part
k_pe shared by every head (contract: reference.mla_prefill_reference).

One program per (block of BLOCK_M queries of one sequence, head): the host builds the table of
query blocks from the step's host lengths (prefill runs eagerly, its lengths are on the host);
each program walks its sequence's keys up to its last query's position with an online softmax in
fp32. A later chunk's queries sit after the sequence's earlier tokens (context - query length)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.precision import dot_precision
from kdaserve.ops.host_tables import tables_to_device


@triton.jit
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, out_ptr, blk_seq_ptr, blk_start_ptr, cu_q_ptr, cu_k_ptr, scale,
    s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_kn_t, s_kn_h, s_kp_t, s_v_t, s_v_h, s_o_t, s_o_h,
    DN: tl.constexpr, R: tl.constexpr, HAS_PE: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(blk_seq_ptr + pid)
    m0 = tl.load(blk_start_ptr + pid)
    q_beg = tl.load(cu_q_ptr + n)
    q_len = tl.load(cu_q_ptr + n + 1) - q_beg
    k_beg = tl.load(cu_k_ptr + n)
    ctx = tl.load(cu_k_ptr + n + 1) - k_beg
    offset = ctx - q_len
    i = m0 + tl.arange(0, BLOCK_M)
    i_ok = i < q_len
    rows_q = (q_beg + i).to(tl.int64)
    dn, r, dv = tl.arange(0, DN), tl.arange(0, R), tl.arange(0, DV)
    qn = tl.load(qn_ptr + rows_q[:, None] * s_qn_t + h * s_qn_h + dn[None, :], mask=i_ok[:, None], other=0.0)
    if HAS_PE:
        qp = tl.load(qp_ptr + rows_q[:, None] * s_qp_t + h * s_qp_h + r[None, :], mask=i_ok[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    last = tl.minimum(ctx, offset + m0 + BLOCK_M)        # keys this block may see
    for j0 in range(0, last, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < last
        rows_k = (k_beg + j).to(tl.int64)
        kn = tl.load(kn_ptr + rows_k[:, None] * s_kn_t + h * s_kn_h + dn[None, :], mask=j_ok[:, None], other=0.0)
        vv = tl.load(v_ptr + rows_k[:, None] * s_v_t + h * s_v_h + dv[None, :], mask=j_ok[:, None], other=0.0)
        s = tl.dot(qn, tl.trans(kn), input_precision=PREC)
        if HAS_PE:
            kp = tl.load(kp_ptr + rows_k[:, None] * s_kp_t + r[None, :], mask=j_ok[:, None], other=0.0)
            s = tl.dot(qp, tl.trans(kp), s, input_precision=PREC)
        s = s * scale
        allowed = j_ok[None, :] & (j[None, :] <= offset + i[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PREC)
        m = m_new
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + rows_q[:, None] * s_o_t + h * s_o_h + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=i_ok[:, None])


def launch_shape(dn: int, dv: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) on the GPU: the largest tiles that do not spill on sm_90
    (tools/compile_check.py): [64, 32] at Kimi-Linear's 128-wide heads; [32, 32] at GLM-5.3-Flash's
    256-wide ones, which spill on none of sm_89, sm_90, sm_100, gfx942, gfx950 ([64, 32] spills
    120 bytes on sm_90, [64, 16] 56 on sm_89)."""
    return (64, 32, 8) if dn + dv <= 256 else (32, 32, 8)


def _pow2(d: int, what: str, zero_ok: bool = False) -> None:
    if (d < 16 or d & (d - 1)) and not (zero_ok and d == 0):
        raise ValueError(f"MLA prefill needs a power-of-two {what} >= 16{' or 0' if zero_ok else ''}, got {d}")


def mla_prefill_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                       v: torch.Tensor, query_lens: list[int], context_lens: list[int], scale: float) -> torch.Tensor:
    """Same contract as reference.mla_prefill_reference (lengths are host lists)."""
    T, H, DN = q_nope.shape
    R, DV = q_pe.shape[-1], v.shape[-1]
    for d, what in ((DN, "qk_nope_head_dim"), (DV, "v_head_dim")):
        _pow2(d, what)
    _pow2(R, "qk_rope_head_dim", zero_ok=True)   # 0: no rope part (GLM-5.3-Flash)
    if any(c < q for q, c in zip(query_lens, context_lens)):
        raise ValueError(f"every context must hold its queries: query lengths {query_lens}, context lengths {context_lens}")
    interpreter_compat.install()
    out = torch.empty(T, H, DV, dtype=q_nope.dtype, device=q_nope.device)
    if T == 0:
        return out
    BLOCK_M, BLOCK_N, warps = launch_shape(DN, DV) if q_nope.is_cuda else (16, 16, 4)   # interpreter: smallest dots
    seq_of_block = np.concatenate([np.full(-(-n // BLOCK_M), i, np.int32) for i, n in enumerate(query_lens)])
    start_of_block = np.concatenate([np.arange(0, n, BLOCK_M, dtype=np.int32) for n in query_lens])
    cu_q = np.zeros(len(query_lens) + 1, np.int32)
    np.cumsum(query_lens, out=cu_q[1:])
    cu_k = np.zeros(len(context_lens) + 1, np.int32)
    np.cumsum(context_lens, out=cu_k[1:])
    blk_seq, blk_start, cu_q_d, cu_k_d = tables_to_device([seq_of_block, start_of_block, cu_q, cu_k], q_nope.device)
    _mla_prefill_kernel[(seq_of_block.shape[0], H)](
        q_nope, q_pe, k_nope, k_pe, v, out, blk_seq, blk_start, cu_q_d, cu_k_d, scale,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        DN=DN, R=max(R, 16), HAS_PE=R > 0, DV=DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PREC="ieee" if q_nope.dtype == torch.float32 else dot_precision(q_nope.device).tensor_core, num_warps=warps, num_stages=2,
    )
    return out
