"""The hybrid causal LM: pre-norm decoder layers whose token mixer is either a KDA layer
("linear_attention") or grouped-query full attention ("full_attention"), each followed by a dense
SwiGLU MLP. Checkpoint names follow HF conventions (`model.layers.{i}.linear_attn.*`,
`model.layers.{i}.self_attn.*`, `model.layers.{i}.mlp.*`, `model.embed_tokens`, `model.norm`,
`lm_head`); `load_weights` maps them onto the merged parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kdaserve.backends import KDABackends
from kdaserve.layers.attention import FullAttention
from kdaserve.layers.distributed import tp_rank, tp_size
from kdaserve.layers.embed_head import VocabEmbedding
from kdaserve.layers.mlp import SwiGLUMLP
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.causal_lm import DecoderStack, KDACausalLM, PreNormDecoderLayer, check_kda_backends
from kdaserve.models.hybrid_config import HybridConfig


def _kda_layer_class():
    from kdaserve.layers.kda import KDALayer

    return KDALayer


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: HybridConfig, layer_idx: int, *, kda_backends: KDABackends | None, dtype, device):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = config.layer_types[layer_idx] == "linear_attention"
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        if self.is_kda:
            self.linear_attn = _kda_layer_class()(h, config.linear_num_heads, kda_backends, layer_idx=layer_idx,
                                                   tp_rank=tp_rank(), tp_size=tp_size(), device=device)
        else:
            self.self_attn = FullAttention(
                h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                rope_theta=config.rope_theta, max_position=config.max_position_embeddings,
                rotary_dim=config.rotary_dim, bias=config.attention_bias, layer_idx=layer_idx,
                dtype=dtype, device=device,
            )
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = SwiGLUMLP(h, config.intermediate_size, dtype=dtype, device=device)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.is_kda else self.self_attn


class HybridModel(DecoderStack):
    def __init__(self, config: HybridConfig, *, kda_backends: KDABackends | None, dtype, device):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, kda_backends=kda_backends, dtype=dtype, device=device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class HybridForCausalLM(KDACausalLM):
    """The engine's model interface (models/causal_lm.py); per-step metadata comes from the context."""

    def __init__(self, config: HybridConfig, *, kda_backends: KDABackends | None, dtype=None, device=None):
        super().__init__()
        check_kda_backends(config, kda_backends)
        self.config, dtype = config, dtype or torch.get_default_dtype()
        self.model = HybridModel(config, kda_backends=kda_backends, dtype=dtype, device=device)
        self.add_head(dtype, device)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by name; returns the names used. KDA layers get their tensors
        in one call each (they refresh derived buffers after a write). Names of layers past
        num_hidden_layers (e.g. multi-token-prediction heads) and rotary tables are skipped."""
        from kdaserve.models.weight_names import route_weights

        return route_weights(self, weights)
