"""Kimi-Linear (Moonshot AI, `KimiLinearForCausalLM`): KDA layers with the unbounded gate, MLA
layers without rotary embedding, a dense first layer and mixture-of-experts layers after it.

Loaded from the **released** tensor names (not transformers' renamed ones):

    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.{i}.input_layernorm.weight, .post_attention_layernorm.weight
    KDA  model.layers.{i}.self_attn.{q,k,v}_proj, b_proj, f_a_proj, f_b_proj, g_a_proj, g_b_proj,
         {q,k,v}_conv1d [P, 1, W], A_log [1, 1, H, 1], dt_bias [P], o_norm, o_proj
    MLA  model.layers.{i}.self_attn.q_proj (or q_a_proj, q_a_layernorm, q_b_proj),
         kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    MLP  model.layers.{i}.mlp.{gate,up,down}_proj                       (layers < first_k_dense_replace)
    MoE  model.layers.{i}.block_sparse_moe.gate.weight, .gate.e_score_correction_bias,
         .experts.{e}.w1/w2/w3.weight, .shared_experts.{gate,up,down}_proj.weight

`released_shapes(config)` lists every tensor of a complete checkpoint; a checkpoint that lacks one,
has one more, or has one of another shape is an error naming it.

FP8 (models/fp8.py): with `--quantization fp8` the routed experts and the projections of the dense
and shared-expert MLPs and of the MLA layers (q, q_a, q_b, kv_a, o; not kv_b) are kept in
block-scaled FP8, quantized at load when the checkpoint is in full precision; an FP8 checkpoint
follows KDASERVE_FP8_WEIGHTS (its experts kept where FP8 dots run)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from kdaserve.backends import KDABackends
from kdaserve.layers.distributed import tp_rank, tp_size
from kdaserve.layers.embed_head import VocabEmbedding
from kdaserve.layers.mla import MLAttention
from kdaserve.layers.mlp import SwiGLUMLP
from kdaserve.layers.moe import MoEMLP
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.causal_lm import DecoderStack, KDACausalLM, PreNormDecoderLayer, check_kda_backends
from kdaserve.models.fp4 import NO_FOUR_BIT_EXPERTS, FourBitExperts
from kdaserve.models.fp8 import Fp8Layout
from kdaserve.models.kimi_linear_config import KimiLinearConfig
from kdaserve.models.random_weights import realistic_released_tensors
from kdaserve.models.released import kda_layer_shapes, load_released, mla_layer_shapes, moe_layer_shapes
from kdaserve.models.weight_names import load_named_tensor

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight(?:_scale_inv|_scale|_global_scale)?)")
# What stays FP8 when the model keeps FP8 weights; attention projections only in MLA layers.
FP8_LAYOUT = Fp8Layout(
    "Kimi-Linear", _LAYER,
    experts=re.compile(r"block_sparse_moe\.experts\.\d+\.w[123]\.weight"),
    mlps=re.compile(r"(?:mlp|block_sparse_moe\.shared_experts)\.(?:gate|up|down)_proj\.weight"),
    attention=re.compile(r"self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight"),
    is_attention_layer=lambda c, i: c.layer_types[i] != "linear_attention",
    widths=lambda c: (c.intermediate_size, c.moe_intermediate_size))
keeps_fp8, fp8_tensors, fp4_tensors = FP8_LAYOUT.keeps, FP8_LAYOUT.tensors, FP8_LAYOUT.four_bit_tensors


class KimiDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: KimiLinearConfig, i: int, *, kda_backends: KDABackends | None, mla_backend: str,
                 moe_backend: str, dtype, device, fp8_block: tuple[int, int] | None = None,
                 fp8_linear_block: tuple[int, int] | None = None, fp4_experts: FourBitExperts = NO_FOUR_BIT_EXPERTS):
        super().__init__()
        c, h = config, config.hidden_size
        self.layer_idx, self.is_kda, self.is_moe = i, c.layer_types[i] == "linear_attention", c.is_moe_layer(i)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        if self.is_kda:
            from kdaserve.layers.kda import KDALayer

            self.self_attn = KDALayer(h, c.linear_num_heads, kda_backends, norm_eps=c.rms_norm_eps, layer_idx=i,
                                      tp_rank=tp_rank(), tp_size=tp_size(), device=device)
        else:
            self.self_attn = MLAttention(
                h, c.num_attention_heads, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank,
                norm_eps=c.rms_norm_eps, layer_idx=i, backend=mla_backend, dtype=dtype, device=device,
                fp8_block=fp8_linear_block,
            )
        if self.is_moe:
            self.block_sparse_moe = MoEMLP(h, c.router, c.moe_intermediate_size, num_shared_experts=c.n_shared_experts,
                                           backend=moe_backend, dtype=dtype, device=device, fp8_block=fp8_block,
                                           shared_fp8_block=fp8_linear_block, fp4=fp4_experts.scheme(i),
                                           shared_fp4=fp4_experts.mlp_scheme(i, shared=True))
        else:
            self.mlp = SwiGLUMLP(h, c.intermediate_size, dtype=dtype, device=device, fp8_block=fp8_linear_block,
                                 fp4=fp4_experts.mlp_scheme(i, shared=False))

    @property
    def feed_forward(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp   # the released names


class KimiLinearModel(DecoderStack):
    def __init__(self, config: KimiLinearConfig, **kw):
        super().__init__()
        dtype, device = kw["dtype"], kw["device"]
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i, **kw) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class KimiLinearForCausalLM(KDACausalLM):
    """The engine's model interface (models/causal_lm.py) over the released checkpoint format."""

    def __init__(self, config: KimiLinearConfig, *, kda_backends: KDABackends | None, mla_backend: str = "auto",
                 moe_backend: str = "auto", dtype=None, device=None, quantization: str | None = None):
        super().__init__()
        check_kda_backends(config, kda_backends)
        self.config, dtype = config, dtype or torch.get_default_dtype()
        self.fp8_block, self.fp8_linear_block = FP8_LAYOUT.blocks(config, device, quantization)
        self.fp4_experts = FP8_LAYOUT.four_bit_experts(config, lambda: released_shapes(config), self.fp8_block)
        self.model = KimiLinearModel(config, kda_backends=kda_backends, mla_backend=mla_backend,
                                     moe_backend=moe_backend, dtype=dtype, device=device, fp8_block=self.fp8_block,
                                     fp8_linear_block=self.fp8_linear_block, fp4_experts=self.fp4_experts)
        self.add_head(dtype, device)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_released_weights(self, weights)


# ---- the released checkpoint format ---------------------------------------------------------------

def released_shapes(config: KimiLinearConfig, fp8_block: tuple[int, int] | None = None,
                    fp8_linears: bool = False, fp4_experts: FourBitExperts = NO_FOUR_BIT_EXPERTS) -> dict[str, tuple[int, ...]]:
    """Every tensor of a complete released checkpoint, with its shape; `fp8_block`: with the
    `weight_scale_inv` of every weight the model keeps in FP8 (the linears too with `fp8_linears`);
    `fp4_experts`: the 4-bit tensors of the experts kept in 4 bits."""
    c = config
    h = c.hidden_size
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (h,)
        s[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        if c.layer_types[i] == "linear_attention":
            s.update(kda_layer_shapes(a, h, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim,
                                      (1, 1, c.linear_num_heads, 1)))
        else:
            s.update(mla_layer_shapes(a, h, c.num_attention_heads, nope=c.qk_nope_head_dim, rope=c.qk_rope_head_dim,
                                      v=c.v_head_dim, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank))
        if c.is_moe_layer(i):
            s.update(moe_layer_shapes(p + "block_sparse_moe.", h, c.num_local_experts, c.moe_intermediate_size,
                                      c.n_shared_experts, parts=("w1", "w3", "w2")))
        else:
            s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
            s[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
    return fp4_experts.with_pieces(FP8_LAYOUT.with_scales(config, s, fp8_block, fp8_linears))


def _is_skipped(name: str, config: KimiLinearConfig) -> bool:
    """Rotary tables and layers past num_hidden_layers (multi-token-prediction heads) are not ours."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = _LAYER.fullmatch(name)
    return bool(m) and int(m[1]) >= config.num_hidden_layers


def load_released_weights(model: KimiLinearForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy released checkpoint tensors into `model`; returns the names loaded. Unknown names, wrong
    shapes and missing tensors are errors that name them."""
    config = model.config

    def top_param(name: str) -> str:
        return "model.embed_tokens.weight" if name == "lm_head.weight" and config.tie_word_embeddings else name

    weights = FP8_LAYOUT.checkpoint_weights(model, weights)
    shapes = released_shapes(config, model.fp8_block, model.fp8_linear_block is not None, model.fp4_experts)
    return load_released(model, weights, shapes, family="Kimi-Linear", layer_name=_LAYER,
                         skip=lambda name: _is_skipped(name, config), top_param=top_param,
                         layer_tensor=lambda i, layer, rest, tensor, params: _load_layer_tensor(model, layer, i, rest,
                                                                                                 tensor, params))


def _load_layer_tensor(model, layer: KimiDecoderLayer, i: int, rest: str, tensor: torch.Tensor, params: dict) -> None:
    e = _EXPERT.fullmatch(rest)
    if e:
        layer.block_sparse_moe.load_expert(int(e[1]), e[2], tensor, piece=e[3])
        return
    renamed = {"block_sparse_moe.gate.weight": "block_sparse_moe.gate_weight",
               "block_sparse_moe.gate.e_score_correction_bias": "block_sparse_moe.e_score_correction_bias"}.get(rest, rest)
    if not load_named_tensor(model, f"model.layers.{i}.{renamed}", tensor, params):
        raise ValueError(f"model.layers.{i}.{rest}: no parameter of the model takes it")


# ---- random weights at any size (tests, `--load-format dummy`) ------------------------------------

def random_released_tensors(config: KimiLinearConfig, seed: int = 0, *, dtype=torch.bfloat16, device="cpu"):
    """Random tensors under the released names, one at a time (models/random_weights.py has the
    rules). Yields (name, tensor)."""
    return realistic_released_tensors(released_shapes(config), seed, dtype=dtype, device=device,
                                      layers=config.num_hidden_layers, embed="model.embed_tokens.weight",
                                      correction_bias="e_score_correction_bias",
                                      out_projections=("o_proj.weight", "down_proj.weight", ".w2.weight"))


__all__ = ["KimiLinearConfig", "KimiLinearForCausalLM", "load_released_weights",
           "random_released_tensors", "released_shapes"]
