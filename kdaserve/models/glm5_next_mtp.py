"""GLM-5.3-Flash's multi-token-prediction layer (index num_hidden_layers; models/mtp_layer.py has the
form): a DSA + MoE block, no hyper-connections, `shared_head.norm` as its final norm. Released names
under `model.language_model.layers.{L}.`: enorm, hnorm, eh_proj, shared_head.norm (shared_head.head
and embed_tokens, copies of the target's, are skipped), and a DSA block's input_layernorm,
self_attn.*, post_attention_layernorm, mlp.*."""

from __future__ import annotations

from torch import nn

from kdaserve.layers.dsa import DSAIndexer, DSAttention
from kdaserve.layers.moe import MoEMLP
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.fp4 import NO_FOUR_BIT_EXPERTS, FourBitExperts
from kdaserve.models.glm5_next_config import Glm5NextConfig
from kdaserve.models.mtp_layer import MTPLayer


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype, device):
        super().__init__()
        self.norm = RMSNorm(hidden, eps, dtype=dtype, device=device)


class Glm5NextMTP(MTPLayer):
    def __init__(self, config: Glm5NextConfig, *, mla_backend: str, moe_backend: str, dtype, device,
                 fp8_block: tuple[int, int] | None = None, fp8_linear_block: tuple[int, int] | None = None,
                 fp4_experts: FourBitExperts = NO_FOUR_BIT_EXPERTS):
        c, h = config, config.hidden_size
        super().__init__(h, c.rms_norm_eps, c.num_hidden_layers, dtype=dtype, device=device)
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
                          fp8_block=fp8_block, shared_fp8_block=fp8_linear_block, fp4=fp4_experts.scheme(self.layer_idx),
                          shared_fp4=fp4_experts.mlp_scheme(self.layer_idx, shared=True))
        self.shared_head = SharedHead(h, c.rms_norm_eps, dtype, device)

    @property
    def final_norm(self) -> nn.Module:
        return self.shared_head.norm


# Copies of the target's tensors some MTP checkpoints carry beside the layer: the target's are used.
# (The layer's own tensors: glm5_next.mtp_shapes.)
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
