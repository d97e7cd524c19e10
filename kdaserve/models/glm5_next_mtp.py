"""GLM-5.3-Flash's multi-token-prediction layer (index num_hidden_layers), the drafter of
`--speculative-config '{"method": "mtp", ...}'`.

For the token at position i it reads the target's final hidden state h_i (what the head reads)
and the embedding of the token at i + 1, and its output, through the shared head, predicts the
token at i + 2:

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])        (the embedding is zero at position 0)
    r = x + attn(input_layernorm(x))                        (DSA attention with its own caches)
    out = shared_head.norm(r + mlp(post_attention_layernorm(r)))

as vLLM's GLM-5.3-Flash MTP layer computes it (no hyper-connections in this block; the embedding
and the head are the target's). Released names under `model.language_model.layers.{L}.`:
enorm, hnorm, eh_proj, shared_head.norm (shared_head.head and embed_tokens, copies of the target's,
are skipped), and a DSA block's input_layernorm, self_attn.*, post_attention_layernorm, mlp.*.
transformers has no such layer: the engine's tests check the drafts against a from-scratch pass
and losslessness against plain decoding."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.layers.dsa import DSAIndexer, DSAttention
from kdaserve.layers.moe import MoEMLP
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.glm5_next_config import Glm5NextConfig


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype, device):
        super().__init__()
        self.norm = RMSNorm(hidden, eps, dtype=dtype, device=device)


class Glm5NextMTP(nn.Module):
    is_kda = False

    def __init__(self, config: Glm5NextConfig, *, mla_backend: str, moe_backend: str, dtype, device,
                 fp8_block: tuple[int, int] | None = None, fp8_linear_block: tuple[int, int] | None = None):
        super().__init__()
        c, h = config, config.hidden_size
        self.layer_idx = c.num_hidden_layers
        self.enorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype, device=device)
        self.eh_proj.requires_grad_(False)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        indexer = DSAIndexer(h, c.q_lora_rank, num_heads=c.index_n_heads, head_dim=c.index_head_dim,
                             kpool=c.index_kpool, topk=c.index_topk, always_select_tail=c.index_kpool_always_select_tail,
                             backend=mla_backend, dtype=dtype, device=device)
        self.self_attn = DSAttention(
            h, c.num_attention_heads, indexer=indexer, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank,
            norm_eps=c.rms_norm_eps, layer_idx=self.layer_idx, backend=mla_backend, dtype=dtype, device=device,
            fp8_block=fp8_linear_block)
        self.mlp = MoEMLP(h, c.router, c.moe_intermediate_size, num_shared_experts=c.n_shared_experts,
                          activation_limit=c.swiglu_limit, backend=moe_backend, dtype=dtype, device=device,
                          fp8_block=fp8_block, shared_fp8_block=fp8_linear_block)
        self.shared_head = SharedHead(h, c.rms_norm_eps, dtype, device)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward(self, next_embeds: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """`next_embeds` [T, h]: embeddings of the tokens after each row's; `target_hidden` [T, h]:
        the target's final hidden state of each row. Returns the post-norm output [T, h] (the
        head reads it; a further draft step would take it as its hidden state)."""
        e = torch.where((positions == 0)[:, None], torch.zeros((), dtype=next_embeds.dtype, device=next_embeds.device),
                        next_embeds)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(target_hidden)], dim=-1))
        x = x + self.self_attn(positions, self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x)


# Copies of the target's tensors some MTP checkpoints carry beside the layer: the target's are used.
# (The layer's own tensors: glm5_next.mtp_shapes.)
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")

