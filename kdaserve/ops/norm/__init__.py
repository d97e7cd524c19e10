"""Norms in Triton: the gated RMSNorm (sigmoid gate, fp32 math) applied per head to the KDA output,
and the decoder layers' RMSNorm fused with the residual add before it."""

from kdaserve.ops.norm.gated_rms_norm import gated_rms_norm_fwd
from kdaserve.ops.norm.rms_norm import rms_norm_fwd

__all__ = ["gated_rms_norm_fwd", "rms_norm_fwd"]
