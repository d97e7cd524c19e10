"""Gated RMSNorm (sigmoid gate, fp32 math) applied per head to the KDA output."""

from kdaserve.ops.norm.gated_rms_norm import gated_rms_norm_fwd

__all__ = ["gated_rms_norm_fwd"]
