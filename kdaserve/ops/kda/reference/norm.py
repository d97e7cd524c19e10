"""Gated RMSNorm applied per head to the KDA output."""

from __future__ import annotations

import torch

from kdaserve.ops.kda.reference.gates import compute_dtype


def gated_rms_norm(o: torch.Tensor, output_gate_logits: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """y = o / sqrt(mean(o^2) + eps) * weight * sigmoid(output_gate_logits), over the last dim, fp32 math.

    o, output_gate_logits: [..., D]; weight: [D]. Returns fp32 (fp64 for fp64 inputs).
    """
    dt = compute_dtype(o, output_gate_logits)
    o = o.to(dt)
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.to(dt) * torch.sigmoid(output_gate_logits.to(dt))
