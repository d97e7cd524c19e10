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
from kdaserve.ops.kda.host_tables import tables_to_device
from kdaserve.ops.precision import WIDE_SHARED_MEMORY_TARGETS, device_target, dot_precision


@triton.jit
def _online_softmax_step(s, vv, m, l, acc, PREC: tl.constexpr):
    """Fold one key block's scores `s`, scaled to base 2 (times scale * log2(e); -inf where not
    allowed), and values into the running max `m` (base 2), sum `l` and output `acc`; a row with
    no allowed key so far keeps m = -inf. Base 2: exp2 is the hardware's instruction, so the
    scale and log2(e) fold into one multiply per score instead of two."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, out_ptr, blk_seq_ptr, blk_start_ptr, cu_q_ptr, cu_k_ptr, scale,
    s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_kn_t, s_kn_h, s_kp_t, s_v_t, s_v_h, s_o_t, s_o_h,
    DN: tl.constexpr, R: tl.constexpr, HAS_PE: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    h = tl.program_id(0)
    pid = tl.program_id(1)
    scale = scale * 1.4426950408889634   # log2(e): scores in base 2 (_online_softmax_step)
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
    # Keys before `full` are visible to every query row of the block: that loop has no masks, so
    # Triton pipelines its loads (a mask that changes with the loop's key block stops it), and
    # only the diagonal's few blocks take the masked loop.
    full = (offset + m0 + 1) // BLOCK_N * BLOCK_N
    for j0 in range(0, full, BLOCK_N):
        rows_k = (k_beg + j0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        kn = tl.load(kn_ptr + rows_k[:, None] * s_kn_t + h * s_kn_h + dn[None, :])
        vv = tl.load(v_ptr + rows_k[:, None] * s_v_t + h * s_v_h + dv[None, :])
        s = tl.dot(qn, tl.trans(kn), input_precision=PREC)
        if HAS_PE:
            kp = tl.load(kp_ptr + rows_k[:, None] * s_kp_t + r[None, :])
            s = tl.dot(qp, tl.trans(kp), s, input_precision=PREC)
        m, l, acc = _online_softmax_step(s * scale, vv, m, l, acc, PREC)
    for j0 in range(full, last, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < last
        rows_k = (k_beg + j).to(tl.int64)
        kn = tl.load(kn_ptr + rows_k[:, None] * s_kn_t + h * s_kn_h + dn[None, :], mask=j_ok[:, None], other=0.0)
        vv = tl.load(v_ptr + rows_k[:, None] * s_v_t + h * s_v_h + dv[None, :], mask=j_ok[:, None], other=0.0)
        s = tl.dot(qn, tl.trans(kn), input_precision=PREC)
        if HAS_PE:
            kp = tl.load(kp_ptr + rows_k[:, None] * s_kp_t + r[None, :], mask=j_ok[:, None], other=0.0)
            s = tl.dot(qp, tl.trans(kp), s, input_precision=PREC)
        allowed = j_ok[None, :] & (j[None, :] <= offset + i[:, None])
        m, l, acc = _online_softmax_step(tl.where(allowed, s * scale, float("-inf")), vv, m, l, acc, PREC)
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + rows_q[:, None] * s_o_t + h * s_o_h + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=i_ok[:, None])


def launch_shape(target: str, dn: int, dv: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) on `target` (ops/precision.device_target). Hopper-class:
    the fastest of bench_moe_mla.py --sweep-mla-prefill on an H200 at 8K and 32K tokens
    (docs/perf-notes.md, twenty-ninth session): [128, 64] in 8 warps and 3 stages at Kimi-Linear's
    128-wide heads, [128, 64] in 8 warps and 2 stages at GLM-5.3-Flash's 256-wide ones (16 B of
    spills on sm_90, 6-8% faster all the same than [128, 32] in 3 stages, which spills nowhere and
    was the faster on an H100). Elsewhere (not timed) tiles that spill on none of sm_89, gfx942,
    gfx950 (tools/compile_check.py)."""
    if target in WIDE_SHARED_MEMORY_TARGETS:
        return (128, 64, 8, 3) if dn + dv <= 256 else (128, 64, 8, 2)
    if dn + dv <= 256:
        return 64, 32, 8, 2
    return (32, 32, 8, 2) if target.startswith("gfx") else (32, 32, 4, 2)


# The grid's second axis (blocks of queries) holds at most 65535 programs: 4M query tokens of one
# step at 64 per block (8M at 128), far above any step's token budget.
MAX_QUERY_BLOCKS = 65535


def _pow2(d: int, what: str, zero_ok: bool = False) -> None:
    if (d < 16 or d & (d - 1)) and not (zero_ok and d == 0):
        raise ValueError(f"MLA prefill needs a power-of-two {what} >= 16{' or 0' if zero_ok else ''}, got {d}")


def mla_prefill_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                       v: torch.Tensor, query_lens: list[int], context_lens: list[int], scale: float, *,
                       launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Same contract as reference.mla_prefill_reference (lengths are host lists). `launch`:
    (BLOCK_M, BLOCK_N, warps, stages) other than launch_shape's (benchmarks)."""
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
    if launch is None:   # interpreter: the smallest dots
        launch = launch_shape(device_target(q_nope.device), DN, DV) if q_nope.is_cuda else (16, 16, 4, 1)
    BLOCK_M, BLOCK_N, warps, stages = launch
    seq_of_block = np.concatenate([np.full(-(-n // BLOCK_M), i, np.int32) for i, n in enumerate(query_lens)])
    if seq_of_block.shape[0] > MAX_QUERY_BLOCKS:
        raise ValueError(f"MLA prefill takes at most {MAX_QUERY_BLOCKS} blocks of {BLOCK_M} queries in one call (the "
                         f"grid's second axis), got {seq_of_block.shape[0]} for {T} tokens; split the step")
    start_of_block = np.concatenate([np.arange(0, n, BLOCK_M, dtype=np.int32) for n in query_lens])
    # The blocks that see the most keys first (heads fastest in the grid), so the causal tail of
    # short blocks fills the last wave instead of a long block running alone at the end.
    ctx, qlen = np.asarray(context_lens, np.int64), np.asarray(query_lens, np.int64)
    keys = np.minimum(ctx[seq_of_block], ctx[seq_of_block] - qlen[seq_of_block] + start_of_block + BLOCK_M)
    order = np.argsort(-keys, kind="stable")
    seq_of_block, start_of_block = seq_of_block[order], start_of_block[order]
    cu_q = np.zeros(len(query_lens) + 1, np.int32)
    np.cumsum(query_lens, out=cu_q[1:])
    cu_k = np.zeros(len(context_lens) + 1, np.int32)
    np.cumsum(context_lens, out=cu_k[1:])
    blk_seq, blk_start, cu_q_d, cu_k_d = tables_to_device([seq_of_block, start_of_block, cu_q, cu_k], q_nope.device)
    _mla_prefill_kernel[(H, seq_of_block.shape[0])](
        q_nope, q_pe, k_nope, k_pe, v, out, blk_seq, blk_start, cu_q_d, cu_k_d, scale,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        DN=DN, R=max(R, 16), HAS_PE=R > 0, DV=DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PREC="ieee" if q_nope.dtype == torch.float32 else dot_precision(q_nope.device).tensor_core,
        num_warps=warps, num_stages=stages,
    )
    return out
