"""Ling-3's multi-token-prediction layer (index num_hidden_layers; models/mtp_layer.py has the form, as
vLLM's Bailing MTP layer computes it): gated MLA with RoPE (its own latent cache, the target's
rotary table) + MoE, `final_layernorm` as its final norm. Released names under `model.layers.{L}.`:
enorm, hnorm, eh_proj, final_layernorm, input_layernorm, attention.*, post_attention_layernorm,
mlp.*. transformers 5.23.0 ignores the layer (it never drafts)."""

from __future__ import annotations

from torch import nn

from kdaserve.layers.norm import RMSNorm
from kdaserve.layers.rotary import RotaryEmbedding
from kdaserve.models.bailing_hybrid import make_mla, make_moe
from kdaserve.models.bailing_hybrid_config import BailingHybridConfig
from kdaserve.models.fp4 import NO_FOUR_BIT_EXPERTS, FourBitExperts
from kdaserve.models.mtp_layer import MTPLayer


class BailingHybridMTP(MTPLayer):
    def __init__(self, config: BailingHybridConfig, rotary: RotaryEmbedding, *, mla_backend: str, moe_backend: str,
                 dtype, device, fp8_block: tuple[int, int] | None = None, fp8_linear_block: tuple[int, int] | None = None,
                 fp4_experts: FourBitExperts = NO_FOUR_BIT_EXPERTS):
        c, h = config, config.hidden_size
        super().__init__(h, c.rms_norm_eps, c.num_hidden_layers, dtype=dtype, device=device)
        self.self_attn = make_mla(c, self.layer_idx, rotary, backend=mla_backend, dtype=dtype, device=device,
                                  fp8_block=fp8_linear_block)
        self.mlp = make_moe(c, self.layer_idx, backend=moe_backend, dtype=dtype, device=device, fp8_block=fp8_block,
                            fp8_linear_block=fp8_linear_block, fp4_experts=fp4_experts)
        self.final_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)

    @property
    def final_norm(self) -> nn.Module:
        return self.final_layernorm
