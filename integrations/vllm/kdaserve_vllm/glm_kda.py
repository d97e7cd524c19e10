"""GLM-5.3-Flash's KDA layer in vLLM with kdaserve's core: `KdaserveGlmKDA` subclasses vLLM's
`Glm5NextLinearAttention` (bounded sigmoid gate, separate q/k/v short-conv weights).

vLLM's GLM layer applies the gated output norm in `forward`, after `_forward`; kdaserve's backends
fuse it into the core's output. So when the plugin is asked, `forward` is taken over (vLLM's
projections unchanged) and the norm moves inside the eager-broken `_forward`: kdaserve's fused norm,
or vLLM's own core followed by vLLM's `o_norm` where a phase is left to vLLM. Either way the norm is
applied exactly once, and what runs after `_forward` (o_proj) is the same in every step, as a
piecewise CUDA graph needs. Unasked, the layer is vLLM's, untouched. The rest: kda_core.py."""

from __future__ import annotations

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.models.glm5next.common.kda import Glm5NextLinearAttention

from kdaserve_vllm.kda_core import KdaserveKDACore

_STOCK_FORWARD = getattr(Glm5NextLinearAttention._forward, "__wrapped__", Glm5NextLinearAttention._forward)


class KdaserveGlmKDA(KdaserveKDACore, Glm5NextLinearAttention):
    upstream_name = "Glm5NextLinearAttention"

    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        super().__init__(config, vllm_config, prefix)
        self._kdaserve_setup(vllm_config, self.kda_lower_bound)
        self._kdaserve_conv = None
        if self.kdaserve_backends is not None and "prefill" not in self.kdaserve_vllm_phases:
            # vLLM's FlashKDA prefill (its choice on Hopper for bf16, D = 128, bounded gate) writes
            # prefix-caching checkpoints inside its launch, and the KV cache spec promises them
            # (prefill_checkpoint_alignment). kdaserve's prefill runs instead and writes none, so
            # the layer must not promise them: as vLLM's Triton prefill, whose checkpoints vLLM
            # takes by cutting prefills at block boundaries ('align' mode).
            self.kda_prefill_backend = "triton"
            self._flashkda_buffer_specs = None
            self._checkpoint_exporter = None

    def _conv_weight(self) -> torch.Tensor:
        if self._kdaserve_conv is None:   # after vLLM loaded the weights (they never change after)
            self._kdaserve_conv = torch.cat([m.weight.view(m.weight.shape[0], m.weight.shape[-1])
                                             for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]).contiguous()
        return self._kdaserve_conv

    def _gate_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.A_log.view(self.local_num_heads), self.dt_bias.view(self.local_num_heads, self.head_dim)

    def kdaserve_project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """vLLM's projections, as its forward computes them: (qkv [T, 3P] before the conv, g1
        [1, T, H, D] forget-gate logits, beta [1, T, H] logits, g2 [T, H, D] output-gate logits)."""
        projected = self.in_proj_qkvbfg_a(hidden_states)[0]
        qkv, beta, f_a, g_a = projected.split(
            [3 * self.local_projection_size, self.local_num_heads, self.head_dim, self.head_dim], dim=-1)
        g1 = self.f_b_proj(f_a)[0].reshape(1, -1, self.local_num_heads, self.head_dim)
        g2 = self.g_b_proj(g_a)[0].reshape(-1, self.local_num_heads, self.head_dim)
        return qkv, g1, beta.unsqueeze(0), g2

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.kdaserve_backends is None:
            return super().forward(hidden_states, positions)
        num_tokens = hidden_states.size(0)
        qkv, g1, beta, g2 = self.kdaserve_project(hidden_states)
        core_attn_out = torch.empty((1, num_tokens, self.local_num_heads, self.head_dim), dtype=hidden_states.dtype,
                                    device=hidden_states.device)
        self._forward(qkv_proj_states=qkv, g1=g1, beta=beta, core_attn_out=core_attn_out, g2=g2)
        return self.o_proj(core_attn_out.reshape(num_tokens, -1))[0]

    @eager_break_during_capture
    def _forward(self, qkv_proj_states: torch.Tensor, g1: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor, g2: torch.Tensor | None = None) -> None:
        if g2 is None:   # vLLM's own forward (the plugin not asked): its core, its norm after
            _STOCK_FORWARD(self, qkv_proj_states, g1, beta, core_attn_out)
        elif not self._kdaserve_core(qkv_proj_states, g1, g2, beta, core_attn_out):
            _STOCK_FORWARD(self, qkv_proj_states, g1, beta, core_attn_out)
            core_attn_out.copy_(self.o_norm(core_attn_out, g2))
