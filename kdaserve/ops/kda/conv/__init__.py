"""Causal conv (width W, SiLU) over the merged q|k|v channels: varlen prefill and decode update.

Semantics are those of kdaserve.ops.kda.reference.conv; see varlen.py and update.py for the design.
"""

from kdaserve.ops.kda.conv.update import causal_conv_update_fwd
from kdaserve.ops.kda.conv.varlen import ConvTables, causal_conv_varlen_fwd, conv_step_tables

__all__ = ["ConvTables", "causal_conv_update_fwd", "causal_conv_varlen_fwd", "conv_step_tables"]
