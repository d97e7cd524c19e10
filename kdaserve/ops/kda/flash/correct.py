"""Output pass of sequence parallelism: o_t = o_loc_t + S_start q~_t, then the gated RMSNorm.

Fully parallel: one program per (segment, head, group of chunks); no chain between chunks. A
sequence's first segment ran from the true initial state, so its o_loc is already final (no
correction, and its q~ was never written: it is not read). The correction is one
[V, K] x [K, C] dot per chunk with 16-bit operands and fp32 accumulation, like the recurrence's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.kda.flash.output_norm import store_gated_norm


@triton.jit
def flash_correct_kernel(
    oq_ptr, start_ptr,
    o_ptr, stride_o_t, stride_o_h, stride_o_d,
    out_gate_ptr, stride_out_gate_t, stride_out_gate_h, stride_out_gate_d,
    nw_ptr, eps,
    cu_ptr, idx_ptr, seg_seq_ptr, seg_tok_ptr, seg_end_ptr, q_off,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, CPG: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr,
):
    # Grid (segments x heads, chunk groups): the number of groups follows the step's longest
    # sequence, so it is the grid's second axis rather than a compiled constant (a constexpr would
    # compile a new variant for every new prompt length, past the engine's warm-up).
    pid = tl.program_id(0)
    gi = tl.program_id(1)
    h = pid % H
    s = pid // H
    n = tl.load(seg_seq_ptr + s)
    if n < 0:
        return
    slot = tl.load(idx_ptr + n)
    if slot <= 0:
        return
    seq_start = tl.load(cu_ptr + n)
    tok0 = tl.load(seg_tok_ptr + s)
    tok1 = tl.load(seg_end_ptr + s)
    a0 = tok0 + gi * (CPG * C)
    if a0 >= tok1:
        return
    later = tok0 != seq_start
    vrows = tl.arange(0, D)
    kcols = tl.arange(0, D)
    crow = tl.arange(0, C)
    St = tl.load(start_ptr + (s.to(tl.int64) * H + h) * (D * D) + vrows[:, None] * D + kcols[None, :],
                 mask=later, other=0.0).to(DOT_DTYPE)
    nw = tl.load(nw_ptr + vrows).to(tl.float32)
    n_chunks = tl.minimum((tok1 - a0 + C - 1) // C, CPG)
    for c in range(n_chunks):
        toks = a0 + c * C + crow
        tmask = (toks < tok1)[None, :]
        trow = toks.to(tl.int64)[None, :]
        row = trow * (H * D) + h * D
        o = tl.load(oq_ptr + row + vrows[:, None], mask=tmask, other=0.0).to(tl.float32)      # [V, C]
        qt = tl.load(oq_ptr + q_off + row + kcols[:, None], mask=tmask & later, other=0.0)    # [K, C]
        o = tl.dot(St, qt.to(DOT_DTYPE), acc=o, input_precision=PREC)
        store_gated_norm(o, trow, tmask, h, vrows, nw, eps, out_gate_ptr, stride_out_gate_t, stride_out_gate_h,
                         stride_out_gate_d, o_ptr, stride_o_t, stride_o_h, stride_o_d, D, FAST)
