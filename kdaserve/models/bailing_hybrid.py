"""Ling-3 (inclusionAI, `model_type: bailing_hybrid`, transformers' `BailingHybridForCausalLM`): KDA
layers with **full-rank** gates (f_proj, g_proj [P, hidden]) and the bounded gate, gated MLA layers
with interleaved partial RoPE, dense first layers then mixture-of-experts with group-limited
routing, and a multi-token-prediction layer (models/bailing_hybrid_mtp.py).

    KDA  the bounded (safe) gate LB·sigmoid(exp(A_log)·(f_proj(x) + dt_bias)) (kda_safe_gate; else
         Kimi's unbounded gate), beta = sigmoid(b_proj(x)), sigmoid-gated RMSNorm by g_proj(x)
    MLA  no q-LoRA (q_proj; a config with q_lora_rank gets q_a_proj, q_a_layernorm, q_b_proj),
         RoPE on the qk_rope_head_dim dims of q and of the shared key, pairs interleaved, rope_theta
         from the config; the head's output times sigmoid(g_proj(x)) [heads] before `dense`
    MoE  sigmoid scores, `expert_bias` as the correction bias, the best topk_group of n_group groups
         (a group's score: its top-2), renormalised, times routed_scaling_factor; shared experts

Loaded from the **released** tensor names:

    model.word_embeddings.weight, model.norm.weight, lm_head.weight
    model.layers.{i}.input_layernorm.weight, .post_attention_layernorm.weight
    KDA  model.layers.{i}.attention.{q,k,v}_proj, {q,k,v}_conv1d [P, 1, W], f_proj, g_proj, b_proj,
         A_log [H], dt_bias [P], o_norm, dense
    MLA  model.layers.{i}.attention.q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, g_proj, dense
    MLP  model.layers.{i}.mlp.{gate,up,down}_proj                       (the "dense" layers)
    MoE  model.layers.{i}.mlp.gate.weight, .gate.expert_bias, .experts.{e}.{gate,up,down}_proj.weight,
         .shared_experts.{gate,up,down}_proj.weight
    MTP  model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj, final_layernorm} and an MLA + MoE
         layer's tensors (loaded with `mtp=True`, else skipped with one log line)

A missing tensor, one more, or one of another shape is an error naming it. FP8 block-scaled
checkpoints follow models/fp8.py as the other families do: the routed experts stay FP8 where FP8
dots run; with --quantization fp8 the MLPs' and the MLA layers' projections too (q, q_a, q_b, kv_a,
dense; not kv_b, read as absorbed views, nor the small head gate); the KDA layers' are dequantized."""

from __future__ import annotations

import logging
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
from kdaserve.layers.rotary import RotaryEmbedding
from kdaserve.models.bailing_hybrid_config import BailingHybridConfig
from kdaserve.models.causal_lm import DecoderStack, KDACausalLM, PreNormDecoderLayer, check_kda_backends
from kdaserve.models.fp4 import NO_FOUR_BIT_EXPERTS, FourBitExperts
from kdaserve.models.fp8 import Fp8Layout
from kdaserve.models.random_weights import realistic_released_tensors
from kdaserve.models.released import load_released, mla_layer_shapes, moe_layer_shapes, skips_mtp_tensor

log = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight(?:_scale_inv|_scale|_global_scale)?)")
_EXPERT_PART = {"gate": "w1", "up": "w3", "down": "w2"}
FP8_LAYOUT = Fp8Layout(
    "Ling-3", _LAYER,
    experts=re.compile(r"mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight"),
    mlps=re.compile(r"mlp\.(?:shared_experts\.)?(?:gate|up|down)_proj\.weight"),
    attention=re.compile(r"attention\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|dense)\.weight"),
    is_attention_layer=lambda c, i: i >= c.num_hidden_layers or c.layer_types[i] != "linear_attention",
    widths=lambda c: (c.intermediate_size, c.moe_intermediate_size))
keeps_fp8, fp8_tensors, fp4_tensors = FP8_LAYOUT.keeps, FP8_LAYOUT.tensors, FP8_LAYOUT.four_bit_tensors
# Copies of the target's tensors an MTP layer may carry (the target's are used).
MTP_SHARED_COPIES = ("embed_tokens.weight", "word_embeddings.weight", "shared_head.head.weight")


def model_name(rest: str) -> str:
    """The model's name of a layer tensor's released name (`rest` after `model.layers.{i}.`)."""
    if rest.startswith("attention."):
        rest = "self_attn." + rest.removeprefix("attention.")
        if rest.startswith("self_attn.dense."):
            rest = "self_attn.o_proj." + rest.removeprefix("self_attn.dense.")
    return {"mlp.gate.weight": "mlp.gate_weight", "mlp.gate.expert_bias": "mlp.e_score_correction_bias"}.get(rest, rest)


def make_rotary(config: BailingHybridConfig, device) -> RotaryEmbedding:
    """One table for every MLA layer (and the MTP layer): interleaved pairs over qk_rope_head_dim."""
    r = config.qk_rope_head_dim
    return RotaryEmbedding(r, r, config.max_position_embeddings, config.rope_theta, interleaved=True, device=device)


def make_mla(config: BailingHybridConfig, layer_idx: int, rotary: RotaryEmbedding, *, backend: str, dtype, device,
             fp8_block: tuple[int, int] | None) -> MLAttention:
    c = config
    return MLAttention(c.hidden_size, c.num_attention_heads, kv_lora_rank=c.kv_lora_rank,
                       qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                       q_lora_rank=c.q_lora_rank, norm_eps=c.rms_norm_eps, layer_idx=layer_idx, backend=backend,
                       dtype=dtype, device=device, fp8_block=fp8_block, rotary=rotary, head_gate=True)


def make_moe(config: BailingHybridConfig, i: int, *, backend: str, dtype, device, fp8_block, fp8_linear_block,
             fp4_experts: FourBitExperts) -> MoEMLP:
    c = config
    return MoEMLP(c.hidden_size, c.router, c.moe_intermediate_size, num_shared_experts=c.n_shared_experts,
                  backend=backend, dtype=dtype, device=device, fp8_block=fp8_block, shared_fp8_block=fp8_linear_block,
                  fp4=fp4_experts.scheme(i), shared_fp4=fp4_experts.mlp_scheme(i, shared=True))


class BailingDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: BailingHybridConfig, i: int, rotary: RotaryEmbedding, *,
                 kda_backends: KDABackends | None, mla_backend: str, moe_backend: str, dtype, device,
                 fp8_block: tuple[int, int] | None = None, fp8_linear_block: tuple[int, int] | None = None,
                 fp4_experts: FourBitExperts = NO_FOUR_BIT_EXPERTS):
        super().__init__()
        c, h = config, config.hidden_size
        self.layer_idx, self.is_kda, self.is_moe = i, c.layer_types[i] == "linear_attention", c.is_moe_layer(i)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        if self.is_kda:
            from kdaserve.layers.kda import KDALayer

            self.self_attn = KDALayer(h, c.linear_num_heads, kda_backends, norm_eps=c.rms_norm_eps, layer_idx=i,
                                      tp_rank=tp_rank(), tp_size=tp_size(), full_rank_gates=True, device=device)
        else:
            self.self_attn = make_mla(c, i, rotary, backend=mla_backend, dtype=dtype, device=device,
                                      fp8_block=fp8_linear_block)
        if self.is_moe:
            self.mlp = make_moe(c, i, backend=moe_backend, dtype=dtype, device=device, fp8_block=fp8_block,
                                fp8_linear_block=fp8_linear_block, fp4_experts=fp4_experts)
        else:
            self.mlp = SwiGLUMLP(h, c.intermediate_size, dtype=dtype, device=device, fp8_block=fp8_linear_block,
                                 fp4=fp4_experts.mlp_scheme(i, shared=False))


class BailingHybridModel(DecoderStack):
    def __init__(self, config: BailingHybridConfig, rotary: RotaryEmbedding, **kw):
        super().__init__()
        dtype, device = kw["dtype"], kw["device"]
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(BailingDecoderLayer(config, i, rotary, **kw) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class BailingHybridForCausalLM(KDACausalLM):
    """The engine's model interface (models/causal_lm.py) over the released checkpoint format."""

    def __init__(self, config: BailingHybridConfig, *, kda_backends: KDABackends | None, mla_backend: str = "auto",
                 moe_backend: str = "auto", dtype=None, device=None, mtp: bool = False,
                 quantization: str | None = None):
        super().__init__()
        check_kda_backends(config, kda_backends)
        self.config, dtype = config, dtype or torch.get_default_dtype()
        self.fp8_block, self.fp8_linear_block = FP8_LAYOUT.blocks(config, device, quantization)
        self.fp4_experts = FP8_LAYOUT.four_bit_experts(config, lambda: released_shapes(config, mtp), self.fp8_block)
        fp8 = dict(fp8_block=self.fp8_block, fp8_linear_block=self.fp8_linear_block, fp4_experts=self.fp4_experts)
        rotary = make_rotary(config, device)
        self.model = BailingHybridModel(config, rotary, kda_backends=kda_backends, mla_backend=mla_backend,
                                        moe_backend=moe_backend, dtype=dtype, device=device, **fp8)
        self.add_head(dtype, device)
        if mtp:
            from kdaserve.models.bailing_hybrid_mtp import BailingHybridMTP

            self.add_mtp(lambda: BailingHybridMTP(config, rotary, mla_backend=mla_backend, moe_backend=moe_backend,
                                                  dtype=dtype, device=device, **fp8))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_released_weights(self, weights)


# ---- the released checkpoint format ---------------------------------------------------------------

def released_shapes(config: BailingHybridConfig, mtp: bool = False, fp8_block: tuple[int, int] | None = None,
                    fp8_linears: bool = False,
                    fp4_experts: FourBitExperts = NO_FOUR_BIT_EXPERTS) -> dict[str, tuple[int, ...]]:
    """Every tensor of a complete released checkpoint, with its shape; `mtp`: with the
    multi-token-prediction layer; `fp8_block`: with the `weight_scale_inv` of every weight the
    model keeps in FP8 (the experts; the linear projections too with `fp8_linears`)."""
    c, h = config, config.hidden_size
    s: dict[str, tuple[int, ...]] = {"model.word_embeddings.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (h,)
        if c.layer_types[i] == "linear_attention":
            s.update(_kda_shapes(p + "attention.", c))
        else:
            s.update(_mla_shapes(p + "attention.", c))
        if c.is_moe_layer(i):
            s.update(_moe_shapes(p + "mlp.", c))
        else:
            s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
            s[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
    if mtp:
        s.update(mtp_shapes(c))
    return fp4_experts.with_pieces(FP8_LAYOUT.with_scales(config, s, fp8_block, fp8_linears))


def mtp_shapes(config: BailingHybridConfig) -> dict[str, tuple[int, ...]]:
    """The released multi-token-prediction layer's tensors (without copies of the embedding and head)."""
    c, h = config, config.hidden_size
    p = f"model.layers.{c.num_hidden_layers}."
    s: dict[str, tuple[int, ...]] = {p + n: (h,) for n in ("enorm.weight", "hnorm.weight", "final_layernorm.weight",
                                                           "input_layernorm.weight", "post_attention_layernorm.weight")}
    s[p + "eh_proj.weight"] = (h, 2 * h)
    s.update(_mla_shapes(p + "attention.", c))
    s.update(_moe_shapes(p + "mlp.", c))
    return s


def _kda_shapes(a: str, c: BailingHybridConfig) -> dict[str, tuple[int, ...]]:
    h, H, D, W = c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    P = H * D
    s = {a + f"{n}.weight": (P, h) for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj")}
    s.update({a + f"{x}_conv1d.weight": (P, 1, W) for x in "qkv"})
    s.update({a + "b_proj.weight": (H, h), a + "A_log": (H,), a + "dt_bias": (P,), a + "o_norm.weight": (D,),
              a + "dense.weight": (h, P)})
    return s


def _mla_shapes(a: str, c: BailingHybridConfig) -> dict[str, tuple[int, ...]]:
    s = mla_layer_shapes(a, c.hidden_size, c.num_attention_heads, nope=c.qk_nope_head_dim, rope=c.qk_rope_head_dim,
                         v=c.v_head_dim, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank)
    s[a + "dense.weight"] = s.pop(a + "o_proj.weight")
    s[a + "g_proj.weight"] = (c.num_attention_heads, c.hidden_size)
    return s


def _moe_shapes(m: str, c: BailingHybridConfig) -> dict[str, tuple[int, ...]]:
    return moe_layer_shapes(m, c.hidden_size, c.num_local_experts, c.moe_intermediate_size, c.n_shared_experts,
                            bias="expert_bias")


def _skipped(name: str, config: BailingHybridConfig, notes: set[str], mtp: bool) -> bool:
    """Rotary tables; the MTP layer unless it drafts (one note), its copies of embedding and head."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = _LAYER.fullmatch(name)
    return bool(m) and skips_mtp_tensor(int(m[1]), m[2], config.num_hidden_layers, mtp, MTP_SHARED_COPIES, notes)


def load_released_weights(model: BailingHybridForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy released checkpoint tensors into `model`; returns the names loaded. FP8 weights with
    their `weight_scale_inv` are dequantized first unless kept. Unknown names, wrong shapes and
    missing tensors are errors that name them."""
    config, notes, mtp = model.config, set(), model.mtp is not None

    def top_param(name: str) -> str:
        if name == "model.word_embeddings.weight" or (name == "lm_head.weight" and config.tie_word_embeddings):
            return "model.embed_tokens.weight"
        return name

    loaded = load_released(
        model, FP8_LAYOUT.checkpoint_weights(model, weights),
        released_shapes(config, mtp, model.fp8_block, model.fp8_linear_block is not None, model.fp4_experts),
        family="Ling-3 (this config)", layer_name=_LAYER, skip=lambda name: _skipped(name, config, notes, mtp),
        top_param=top_param, rename=model_name,
        layer_tensor=lambda i, layer, rest, tensor, params: _load_layer_tensor(model, layer, i, rest, tensor, params),
        layer_of=lambda i: model.mtp if i == config.num_hidden_layers else model.model.layers[i])
    for note in sorted(notes):
        log.info("Ling-3 checkpoint: skipped %s", note)
    return loaded


def _load_layer_tensor(model, layer, i: int, rest: str, tensor: torch.Tensor, params: dict) -> None:
    from kdaserve.models.weight_names import load_named_tensor

    e = _EXPERT.fullmatch(rest)
    if e:
        layer.mlp.load_expert(int(e[1]), _EXPERT_PART[e[2]], tensor, piece=e[3])
        return
    where = "mtp" if layer is model.mtp else f"model.layers.{i}"
    if not load_named_tensor(model, f"{where}.{rest}", tensor, params):
        raise ValueError(f"model.layers.{i}.{rest}: no parameter of the model takes it")


# ---- random weights at any size (tests, `--load-format dummy`) ------------------------------------

def random_released_tensors(config: BailingHybridConfig, seed: int = 0, *, dtype=torch.bfloat16, device="cpu",
                            mtp: bool | None = None):
    """Random tensors under the released names, one at a time (models/random_weights.py has the
    rules). `mtp`: with the multi-token-prediction layer (None: when the config has one). Yields
    (name, tensor)."""
    mtp = config.num_mtp_layers > 0 if mtp is None else mtp
    return realistic_released_tensors(released_shapes(config, mtp), seed, dtype=dtype, device=device,
                                      layers=config.num_hidden_layers, embed="model.word_embeddings.weight",
                                      correction_bias="gate.expert_bias", out_projections=("dense.weight", "down_proj.weight"))


__all__ = ["BailingHybridConfig", "BailingHybridForCausalLM", "load_released_weights", "random_released_tensors",
           "released_shapes"]
