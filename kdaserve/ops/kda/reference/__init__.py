"""Torch reference of the KDA layer core: the definition every fast path is judged against.

Everything here is written for clarity and exactness, not speed: math runs in fp32 (fp64 when the
inputs are fp64), sequences and tokens are plain Python loops where that makes the order explicit.
"""

from kdaserve.ops.kda.reference.chunked import kda_chunked_varlen
from kdaserve.ops.kda.reference.conv import causal_conv_update, causal_conv_varlen
from kdaserve.ops.kda.reference.gates import beta_sigmoid, kda_gate, l2norm, l2norm_qk
from kdaserve.ops.kda.reference.kda import kda_decode_reference, kda_prefill_reference, kda_qkv_prepare
from kdaserve.ops.kda.reference.norm import gated_rms_norm
from kdaserve.ops.kda.reference.recurrence import kda_recurrent_spec, kda_recurrent_varlen

__all__ = [
    "beta_sigmoid",
    "causal_conv_update",
    "causal_conv_varlen",
    "gated_rms_norm",
    "kda_chunked_varlen",
    "kda_decode_reference",
    "kda_gate",
    "kda_prefill_reference",
    "kda_qkv_prepare",
    "kda_recurrent_spec",
    "kda_recurrent_varlen",
    "l2norm",
    "l2norm_qk",
]
