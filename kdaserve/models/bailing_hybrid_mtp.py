"""Ling-3's multi-token-prediction layer (index num_hidden_layers), the drafter of
`--speculative-config '{"method": "mtp", ...}'`.

For the token at position i it reads the target's final hidden state h_i and the embedding of the
token at i + 1; through the target's head its output predicts the token at i + 2:

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])        (the embedding is zero at position 0)
    r = x + attn(input_layernorm(x))                        (gated MLA with RoPE, its own cache)
    out = final_layernorm(r + mlp(post_attention_layernorm(r)))

as vLLM's Bailing MTP layer computes it. Released names under `model.layers.{L}.`: enorm, hnorm,
eh_proj, final_layernorm, input_layernorm, attention.*, post_attention_layernorm, mlp.*.
transformers 5.23.0 ignores the layer (it never drafts): the tests check losslessness against plain
decoding and the drafts against a pass from scratch."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.layers.norm import RMSNorm
from kdaserve.layers.rotary import RotaryEmbedding
from kdaserve.models.bailing_hybrid import make_mla, make_moe
from kdaserve.models.bailing_hybrid_config import BailingHybridConfig


class BailingHybridMTP(nn.Module):
    is_kda = False

    def __init__(self, config: BailingHybridConfig, rotary: RotaryEmbedding, *, mla_backend: str, moe_backend: str,
                 dtype, device, fp8_block: tuple[int, int] | None = None, fp8_linear_block: tuple[int, int] | None = None):
        super().__init__()
        c, h = config, config.hidden_size
        self.layer_idx = c.num_hidden_layers
        self.enorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype, device=device)
        self.eh_proj.requires_grad_(False)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = make_mla(c, self.layer_idx, rotary, backend=mla_backend, dtype=dtype, device=device,
                                  fp8_block=fp8_linear_block)
        self.mlp = make_moe(c, backend=moe_backend, dtype=dtype, device=device, fp8_block=fp8_block,
                            fp8_linear_block=fp8_linear_block)
        self.final_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward(self, next_embeds: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """`next_embeds` [T, h]: embeddings of the tokens after each row's; `target_hidden` [T, h]: the
        target's final hidden state of each row. Returns final_layernorm's output [T, h] (the head reads it)."""
        e = torch.where((positions == 0)[:, None], torch.zeros((), dtype=next_embeds.dtype, device=next_embeds.device),
                        next_embeds)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(target_hidden)], dim=-1))
        x = x + self.self_attn(positions, self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x)
