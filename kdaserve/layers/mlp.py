"""Dense SwiGLU MLP with gate and up projections merged into one GEMM; the activation on a GPU in
one Triton launch (ops/activation/swiglu.py), whose torch path is the definition."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.layers.distributed import all_reduce, split, tensor_parallel
from kdaserve.layers.kernel_choice import per_call_choice, takes_triton
from kdaserve.layers.linear import MergedLinear, make_linear
from kdaserve.ops.activation.swiglu import swiglu_reference


class SwiGLUMLP(nn.Module):
    # Checkpoint names -> shard of the merged parameter.
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation_limit: float | None = None,
                 dtype=None, device=None, fp8_block: tuple[int, int] | None = None, backend: str = "auto",
                 reduce_output: bool = True, fp4: str | None = None):
        """Tensor parallel: gate|up column-parallel and down row-parallel over this rank's share of
        `intermediate_size`; the ranks' partial outputs are summed here unless `reduce_output` is
        False (a MoE layer's shared experts: the layer sums them with the routed experts' at once)."""
        super().__init__()
        intermediate_size = split(intermediate_size, "the MLP's intermediate_size")
        self.reduce_output, self.tp = reduce_output, tensor_parallel()
        self.backend = per_call_choice("SwiGLU", backend, torch.device(device or "cpu"))
        # GLM-5.3-Flash's clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit).
        self.activation_limit = activation_limit
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], dtype=dtype, device=device,
                                         fp8_block=fp8_block, fp4=fp4, fp4_backend=self.backend)
        self.down_proj = make_linear(intermediate_size, hidden_size, dtype=dtype, device=device, fp8_block=fp8_block,
                                     fp4=fp4, fp4_backend=self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if takes_triton(self.backend, gate_up):
            from kdaserve.ops.activation.swiglu import swiglu_fwd

            out = self.down_proj(swiglu_fwd(gate_up, self.activation_limit))
        else:
            out = self.down_proj(swiglu_reference(gate_up, self.activation_limit))
        return all_reduce(out, self.tp) if self.reduce_output else out
