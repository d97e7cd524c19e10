"""Kimi-Linear's KDA layer in vLLM with kdaserve's core: `KdaserveKimiKDA` subclasses vLLM's
`KimiGatedDeltaNetAttention` and overrides only `_forward`, the KDA core between vLLM's projections
and its o_proj (vLLM's Kimi layer applies the gated output norm inside `_forward`, as kdaserve's
backends do). `eager_break_during_capture` stays the outermost decorator. What the core keeps of
vLLM's invariants: kda_core.py."""

from __future__ import annotations

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention

from kdaserve_vllm.kda_core import KdaserveKDACore

_STOCK_FORWARD = getattr(KimiGatedDeltaNetAttention._forward, "__wrapped__", KimiGatedDeltaNetAttention._forward)


class KdaserveKimiKDA(KdaserveKDACore, KimiGatedDeltaNetAttention):
    upstream_name = "KimiGatedDeltaNetAttention"

    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        super().__init__(config, vllm_config, prefix)
        self._kdaserve_setup(vllm_config, self.gate_lower_bound)

    def _conv_weight(self) -> torch.Tensor:
        P3, W = self.conv1d.weight.shape[0], self.conv1d.weight.shape[-1]
        return self.conv1d.weight.view(P3, W)

    def _gate_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.A_log, self.dt_bias.view(self.local_num_heads, self.head_dim)

    @eager_break_during_capture
    def _forward(self, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
        if self.kdaserve_backends is None or not self._kdaserve_core(mixed_qkv, g1, g2, beta, core_attn_out):
            _STOCK_FORWARD(self, mixed_qkv, g1, g2, beta, core_attn_out)
