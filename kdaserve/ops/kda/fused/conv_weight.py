"""The derived conv-weight layout the fused decode kernel reads: `[3, W, P]` fp32.

The merged weight is `[3P, W]` (one row of W taps per channel). The kernel wants, for each group
(q, k, v) and tap, the P channels contiguous, so one head's 128 channels of a tap are one
coalesced 512-byte load. Like every derived weight (docs/kda-semantics.md section 4), the layer must
rebuild it after every write of `conv_weight`, in place (`out=`) once a CUDA graph has captured it.
"""

from __future__ import annotations

import torch


def fused_conv_weight_layout(conv_weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`[3P, W]` -> `[3, W, P]` fp32 contiguous; written into `out` (same address) when given."""
    if conv_weight.dim() != 2 or conv_weight.shape[0] % 3:
        raise ValueError(f"conv_weight must be [3P, W] (merged q|k|v), got {tuple(conv_weight.shape)}")
    three_p, W = conv_weight.shape
    derived = conv_weight.detach().view(3, three_p // 3, W).permute(0, 2, 1)
    if out is None:
        return derived.to(torch.float32).contiguous()
    expect = (3, W, three_p // 3)
    if tuple(out.shape) != expect or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous fp32 tensor of shape [3, W, P] = {list(expect)}, "
            f"got {out.dtype} {tuple(out.shape)} (contiguous={out.is_contiguous()})"
        )
    if out.device != conv_weight.device:
        raise ValueError(f"out is on {out.device} but conv_weight on {conv_weight.device}")
    with torch.no_grad():
        out.copy_(derived)
    return out
