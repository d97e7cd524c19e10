"""flash's gated RMSNorm of the outputs, where a program holds whole token outputs (all of V):
y = o * rsqrt(mean(o^2) + eps) * weight * sigmoid(output gate logits), per token, fp32 math. The
unsegmented recurrence applies it inside its chunks; the segment output pass after the correction.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdaserve.ops.kda.flash.fastmath import sigmoid_tanh
from kdaserve.ops.triton_math import rms_rstd


@triton.jit
def store_gated_norm(o, trow, tmask, h, vrows, nw, eps,
                     out_gate_ptr, stride_out_gate_t, stride_out_gate_h, stride_out_gate_d,
                     o_ptr, stride_o_t, stride_o_h, stride_o_d, D: tl.constexpr, FAST: tl.constexpr):
    """Norm, gate and store `o` [V, C] fp32: the outputs of C tokens of head h, one per column
    (token rows `trow` [1, C] int64, `tmask` [1, C]); `nw` [V] fp32 the norm's weight."""
    output_gate_logits = tl.load(out_gate_ptr + trow * stride_out_gate_t + h * stride_out_gate_h
                                 + vrows[:, None] * stride_out_gate_d,
                                 mask=tmask, other=0.0).to(tl.float32)
    rstd = rms_rstd(tl.sum(o * o, axis=0), eps, D)
    y = o * rstd[None, :] * nw[:, None] * sigmoid_tanh(output_gate_logits, FAST)
    tl.store(o_ptr + trow * stride_o_t + h * stride_o_h + vrows[:, None] * stride_o_d,
             y.to(o_ptr.dtype.element_ty), mask=tmask)
