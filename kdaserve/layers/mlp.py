"""Dense SwiGLU MLP with gate and up projections merged into one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.layers.linear import MergedLinear, make_linear


class SwiGLUMLP(nn.Module):
    # Checkpoint names -> shard of the merged parameter.
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation_limit: float | None = None,
                 dtype=None, device=None, fp8_block: tuple[int, int] | None = None):
        super().__init__()
        # GLM-5.3-Flash's clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit).
        self.activation_limit = activation_limit
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], dtype=dtype, device=device,
                                         fp8_block=fp8_block)
        self.down_proj = make_linear(intermediate_size, hidden_size, dtype=dtype, device=device, fp8_block=fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.activation_limit is not None:
            gate, up = gate.clamp(max=self.activation_limit), up.clamp(-self.activation_limit, self.activation_limit)
        return self.down_proj(F.silu(gate) * up)
