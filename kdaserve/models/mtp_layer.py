"""A multi-token-prediction layer (DeepSeek-V3's form, which GLM-5.3-Flash and Ling-3 release at index
num_hidden_layers): the drafter of `--speculative-config '{"method": "mtp", ...}'`.

For the token at position i it reads the target's final hidden state h_i (what the head reads) and
the embedding of the token at i + 1; its output, through the target's head, predicts the token at
i + 2:

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])        (the embedding is zero at position 0)
    r = x + attn(input_layernorm(x))                        (the family's attention, its own caches)
    out = final_norm(r + mlp(post_attention_layernorm(r)))

as vLLM's MTP layers compute it. A family subclasses it with its attention (`self_attn`), MLP
(`mlp`) and final norm (`final_norm`): GLM's shared_head.norm, Ling's final_layernorm. transformers
has no such layer: the engine's tests check the drafts against a pass from scratch and losslessness
against plain decoding."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.layers.norm import RMSNorm


class MTPLayer(nn.Module):
    is_kda = False

    def __init__(self, hidden: int, eps: float, layer_idx: int, *, dtype, device):
        super().__init__()
        self.layer_idx = layer_idx
        self.enorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype, device=device)
        self.eh_proj.requires_grad_(False)
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    @property
    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    def forward(self, next_embeds: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """`next_embeds` [T, h]: embeddings of the tokens after each row's; `target_hidden` [T, h]:
        the target's final hidden state of each row. Returns the final norm's output [T, h] (the
        head reads it; a further draft step would take it as its hidden state)."""
        e = torch.where((positions == 0)[:, None], torch.zeros((), dtype=next_embeds.dtype, device=next_embeds.device),
                        next_embeds)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(target_hidden)], dim=-1))
        x = x + self.self_attn(positions, self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_norm(x)
