"""`fused` decode: conv update, l2norm, gate, beta, delta rule and gated RMSNorm in one launch.

See docs/fused-decode.md for the design and decode_kernel.py for the kernel.
"""

from kdaserve.ops.kda.fused.conv_weight import fused_conv_weight_layout
from kdaserve.ops.kda.fused.decode import FusedDecodeConfig, default_config, kda_decode_fused, launch_fused_decode

__all__ = ["FusedDecodeConfig", "default_config", "fused_conv_weight_layout", "kda_decode_fused", "launch_fused_decode"]
