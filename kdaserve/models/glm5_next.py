"""GLM-5.3-Flash (Z.ai, `Glm5NextForConditionalGeneration`, text part): KDA layers with the bounded
gate, MLA layers without rotary embedding with the DSA indexer (layers/dsa.py), hyper-connections
around every sublayer (layers/hyper_connection.py), dense first layers then mixture-of-experts,
clamped SwiGLU everywhere (`swiglu_limit`).

Loaded from the **released** tensor names (prefix `model.language_model.`, head `lm_head.weight`):

    embed_tokens.weight, norm.weight
    layers.{i}.input_layernorm.weight, .post_attention_layernorm.weight
    layers.{i}.hc_attn_{fn,base,scale}, .hc_ffn_{fn,base,scale}              (fp32)
    KDA  layers.{i}.self_attn.{q,k,v}_proj, b_proj, f_a_proj, f_b_proj, g_a_proj, g_b_proj,
         {q,k,v}_conv1d [P, 1, W], A_log [H], dt_bias [P], o_norm, o_proj
    DSA  layers.{i}.self_attn.q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
         kv_b_proj, o_proj; indexer.{wq_b, wk, k_norm (weight, bias), weights_proj,
         index_kpool_compress_ape, index_kpool_compress_gate}   (no indexer in "shared" layers)
    MLP  layers.{i}.mlp.{gate,up,down}_proj                                   ("dense" layers)
    MoE  layers.{i}.mlp.gate.weight, .gate.e_score_correction_bias,
         .experts.{e}.{gate,up,down}_proj.weight, .shared_experts.{gate,up,down}_proj.weight

The vision tower (`model.visual.*`, models/glm5_next_vision.py) is loaded where the config has one
(a checkpoint without its tensors serves text only, one log line); the multi-token-prediction layer
(index num_hidden_layers, `num_nextn_predict_layers`; models/glm5_next_mtp.py) is loaded when the
model is built with `mtp=True` (`--speculative-config '{"method": "mtp"}'`), else skipped. A
tensor this config lacks, a missing one or one of another shape is an error naming it.

FP8 block-scaled checkpoints (models/fp8.py): where FP8 dots run the routed experts stay in FP8
with their `weight_scale_inv` and run block-scaled FP8 GEMMs; with KDASERVE_FP8_WEIGHTS=keep or
--quantization fp8 (which also quantizes a full-precision checkpoint at load) so do the
projections of the dense and shared-expert MLPs and of the attention layers (q_a, q_b, kv_a, o;
kv_b_proj stays dequantized: decode reads it as absorbed views; FP8_LAYOUT names them). The KDA
layers' and the indexer's projections, and everything else, are dequantized at load."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable

import torch
from torch import nn

from kdaserve.backends import KDABackends
from kdaserve.layers.distributed import tp_rank, tp_size
from kdaserve.layers.dsa import DSAIndexer, DSAttention
from kdaserve.layers.embed_head import VocabEmbedding
from kdaserve.layers.hyper_connection import HyperConnection
from kdaserve.layers.mlp import SwiGLUMLP
from kdaserve.layers.moe import MoEMLP
from kdaserve.layers.norm import RMSNorm
from kdaserve.models.causal_lm import KDACausalLM, check_kda_backends
from kdaserve.models.fp4 import NO_FOUR_BIT_EXPERTS, FourBitExperts
from kdaserve.models.fp8 import Fp8Layout
from kdaserve.models.glm5_next_config import Glm5NextConfig
from kdaserve.models.glm5_next_images import ImageRules, canvas_pixels
from kdaserve.models.glm5_next_mtp import SHARED_COPIES, Glm5NextMTP
from kdaserve.models.glm5_next_vision import Glm5NextVisionTower
from kdaserve.models.released import kda_layer_shapes, load_released, mla_layer_shapes, moe_layer_shapes, skips_mtp_tensor
from kdaserve.models.weight_names import load_named_tensor

log = logging.getLogger(__name__)

PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
_LAYER = re.compile(r"model\.language_model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight(?:_scale_inv|_scale|_global_scale)?)")
# Layer tensors kept in FP8 (with their scales) when the model keeps FP8 weights; attention
# projections only in attention layers (a KDA layer's o_proj is dequantized), the MTP layer's too.
FP8_LAYOUT = Fp8Layout(
    "GLM-5.3-Flash", _LAYER,
    experts=re.compile(r"mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight"),
    mlps=re.compile(r"mlp\.(?:shared_experts\.)?(?:gate|up|down)_proj\.weight"),
    attention=re.compile(r"self_attn\.(?:q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|o_proj)\.weight"),
    is_attention_layer=lambda c, i: i >= c.num_hidden_layers or c.layer_types[i] != "linear_attention",
    widths=lambda c: (c.intermediate_size, c.moe_intermediate_size))
keeps_fp8, fp8_tensors, fp4_tensors = FP8_LAYOUT.keeps, FP8_LAYOUT.tensors, FP8_LAYOUT.four_bit_tensors
_EXPERT_PART = {"gate": "w1", "up": "w3", "down": "w2"}
_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)")


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, config: Glm5NextConfig, i: int, *, kda_backends: KDABackends | None, mla_backend: str,
                 moe_backend: str, dtype, device, fp8_block: tuple[int, int] | None = None,
                 fp8_linear_block: tuple[int, int] | None = None, fp4_experts: FourBitExperts = NO_FOUR_BIT_EXPERTS):
        super().__init__()
        c, h = config, config.hidden_size
        self.layer_idx, self.is_kda, self.is_moe = i, c.layer_types[i] == "linear_attention", c.is_moe_layer(i)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
        hc = dict(sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps, device=device,
                  backend=mla_backend)   # mHC follows --mla-backend (auto: Triton on a GPU)
        self.attn_hc = HyperConnection(h, c.hc_mult, **hc)
        self.ffn_hc = HyperConnection(h, c.hc_mult, **hc)
        if self.is_kda:
            from kdaserve.layers.kda import KDALayer

            self.self_attn = KDALayer(h, c.linear_num_heads, kda_backends, norm_eps=c.rms_norm_eps, layer_idx=i,
                                      tp_rank=tp_rank(), tp_size=tp_size(), device=device)
        else:
            indexer = None
            if c.indexer_types[i] == "full":
                indexer = DSAIndexer(h, c.q_lora_rank, num_heads=c.index_n_heads, head_dim=c.index_head_dim,
                                     kpool=c.index_kpool, topk=c.index_topk,
                                     always_select_tail=c.index_kpool_always_select_tail, backend=mla_backend,
                                     dtype=dtype, device=device)
            self.self_attn = DSAttention(
                h, c.num_attention_heads, indexer=indexer, kv_lora_rank=c.kv_lora_rank,
                qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                q_lora_rank=c.q_lora_rank, norm_eps=c.rms_norm_eps, layer_idx=i, backend=mla_backend, dtype=dtype,
                device=device, fp8_block=fp8_linear_block,
            )
        if self.is_moe:
            self.mlp = MoEMLP(h, c.router, c.moe_intermediate_size, num_shared_experts=c.n_shared_experts,
                              activation_limit=c.swiglu_limit, backend=moe_backend, dtype=dtype, device=device,
                              fp8_block=fp8_block, shared_fp8_block=fp8_linear_block, fp4=fp4_experts.scheme(i),
                              shared_fp4=fp4_experts.mlp_scheme(i, shared=True))
        else:
            self.mlp = SwiGLUMLP(h, c.intermediate_size, activation_limit=c.swiglu_limit, dtype=dtype, device=device,
                                 fp8_block=fp8_linear_block, fp4=fp4_experts.mlp_scheme(i, shared=False))

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward(self, positions: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        x = self.self_attn(x) if self.is_kda else self.self_attn(positions, x)
        streams = self.attn_hc.update(streams, x, post, comb)
        post, comb, x = self.ffn_hc(streams)
        x = self.mlp(self.post_attention_layernorm(x))
        return self.ffn_hc.update(streams, x, post, comb)


class Glm5NextModel(nn.Module):
    def __init__(self, config: Glm5NextConfig, **kw):
        super().__init__()
        dtype, device = kw["dtype"], kw["device"]
        self.hc_mult = config.hc_mult
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(config, i, **kw) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        for i, layer in enumerate(self.layers):   # a shared DSA layer reuses the selection of the layer before it
            if not layer.is_kda and layer.self_attn.indexer is None:
                layer.self_attn.source = self.layers[i - 1].self_attn

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, images=None) -> torch.Tensor:
        """`images`: (rows [R] int64, embeddings [R, hidden]) replacing those rows' token embeddings
        (the image placeholders'; engine/encoder_cache.py)."""
        x = self.embed_tokens(input_ids)
        if images is not None:
            rows, embeds = images
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams)
        return self.norm(streams.mean(dim=1))


class Glm5NextForCausalLM(KDACausalLM):
    """The engine's model interface (models/causal_lm.py) over the released checkpoint format."""

    def __init__(self, config: Glm5NextConfig, *, kda_backends: KDABackends | None, mla_backend: str = "auto",
                 moe_backend: str = "auto", dtype=None, device=None, mtp: bool = False,
                 quantization: str | None = None, images: bool = True):
        """`images`: build the vision tower where the config has one (the checkpoint's `model.visual.*`;
        a checkpoint without any of them serves text only); False: text only (--limit-mm-per-prompt
        '{"image": 0}')."""
        super().__init__()
        check_kda_backends(config, kda_backends)
        self.config, dtype = config, dtype or torch.get_default_dtype()
        self.fp8_block, self.fp8_linear_block = FP8_LAYOUT.blocks(config, device, quantization)
        self.fp4_experts = FP8_LAYOUT.four_bit_experts(config, lambda: released_shapes(config, mtp), self.fp8_block)
        fp8 = dict(fp8_block=self.fp8_block, fp8_linear_block=self.fp8_linear_block, fp4_experts=self.fp4_experts)
        self.model = Glm5NextModel(config, kda_backends=kda_backends, mla_backend=mla_backend,
                                   moe_backend=moe_backend, dtype=dtype, device=device, **fp8)
        self.add_head(dtype, device)
        vision = config.vision if images else None
        self.visual = Glm5NextVisionTower(vision, dtype=dtype, device=device) if vision is not None else None
        self.image_rules = ImageRules()   # the released processing; the loader reads a checkpoint's own
        if mtp:
            self.add_mtp(lambda: Glm5NextMTP(config, mla_backend=mla_backend, moe_backend=moe_backend, dtype=dtype,
                                             device=device, **fp8))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_released_weights(self, weights)

    @property
    def image_token_id(self) -> int | None:
        """The placeholder token images replace, or None when the model serves text only."""
        return self.config.image_token_id if self.visual is not None else None

    def image_pixels(self, canvas: torch.Tensor) -> torch.Tensor:
        """A processed image's uint8 canvas (on the tower's device) -> its float32 patches, by the
        checkpoint's processing rules (models/glm5_next_images.canvas_pixels)."""
        return canvas_pixels(canvas, self.image_rules)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Images' patches (concatenated, float32) -> [their tokens, hidden]: one embedding per placeholder."""
        return self.visual(pixel_values, grids)


# ---- the released checkpoint format ---------------------------------------------------------------

def released_shapes(config: Glm5NextConfig, mtp: bool = False, fp8_block: tuple[int, int] | None = None,
                    fp8_linears: bool = False,
                    fp4_experts: FourBitExperts = NO_FOUR_BIT_EXPERTS) -> dict[str, tuple[int, ...]]:
    """Every tensor of a complete released checkpoint (text part), with its shape; `mtp`: with
    the multi-token-prediction layer; `fp8_block`: with the `weight_scale_inv` of every weight
    the model keeps in FP8 (the experts; the linear projections too with `fp8_linears`)."""
    s = _target_shapes(config)
    if mtp:
        s.update(mtp_shapes(config))
    return fp4_experts.with_pieces(FP8_LAYOUT.with_scales(config, s, fp8_block, fp8_linears))


def vision_shapes(config: Glm5NextConfig) -> dict[str, tuple[int, ...]]:
    """The vision tower's tensors (`model.visual.*`) with their shapes, {} without a tower: what the
    capacity check adds for a model built with images (the tower built on the meta device)."""
    if config.vision is None:
        return {}
    tower = Glm5NextVisionTower(config.vision, device="meta")
    return {VISION_PREFIX + name: tuple(p.shape) for name, p in tower.state_dict().items()}


def _target_shapes(config: Glm5NextConfig) -> dict[str, tuple[int, ...]]:
    c, h = config, config.hidden_size
    s: dict[str, tuple[int, ...]] = {PREFIX + "embed_tokens.weight": (c.vocab_size, h), PREFIX + "norm.weight": (h,)}
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (c.vocab_size, h)
    N = c.hc_mult
    for i in range(c.num_hidden_layers):
        p = f"{PREFIX}layers.{i}."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (h,)
        for kind in ("attn", "ffn"):
            s[p + f"hc_{kind}_fn"] = ((2 + N) * N, N * h)
            s[p + f"hc_{kind}_base"] = ((2 + N) * N,)
            s[p + f"hc_{kind}_scale"] = (3,)
        a = p + "self_attn."
        if c.layer_types[i] == "linear_attention":
            s.update(kda_layer_shapes(a, h, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim,
                                      (c.linear_num_heads,)))
        else:
            s.update(_mla_shapes(a, c))
            if c.indexer_types[i] == "full":
                s.update(_indexer_shapes(a + "indexer.", c))
        m = p + "mlp."
        if c.is_moe_layer(i):
            s.update(_moe_shapes(m, c))
        else:
            s[m + "gate_proj.weight"] = s[m + "up_proj.weight"] = (c.intermediate_size, h)
            s[m + "down_proj.weight"] = (h, c.intermediate_size)
    return s



def mtp_shapes(config: Glm5NextConfig) -> dict[str, tuple[int, ...]]:
    """The released multi-token-prediction layer's tensors (models/glm5_next_mtp.py; without the
    copies of the target's embedding and head), with their shapes: a DSA + MoE block, no mHC."""
    c, h = config, config.hidden_size
    p = f"{PREFIX}layers.{c.num_hidden_layers}."
    s: dict[str, tuple[int, ...]] = {p + n: (h,) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                                                           "input_layernorm.weight", "post_attention_layernorm.weight")}
    s[p + "eh_proj.weight"] = (h, 2 * h)
    s.update(_mla_shapes(p + "self_attn.", c))
    s.update(_indexer_shapes(p + "self_attn.indexer.", c))
    s.update(_moe_shapes(p + "mlp.", c))
    return s


def _mla_shapes(prefix: str, c: Glm5NextConfig) -> dict[str, tuple[int, ...]]:
    return mla_layer_shapes(prefix, c.hidden_size, c.num_attention_heads, nope=c.qk_nope_head_dim, rope=0,
                            v=c.v_head_dim, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank)


def _indexer_shapes(x: str, c: Glm5NextConfig) -> dict[str, tuple[int, ...]]:
    h, Hi, Di = c.hidden_size, c.index_n_heads, c.index_head_dim
    return {x + "wq_b.weight": (Hi * Di, c.q_lora_rank), x + "wk.weight": (Di, h), x + "k_norm.weight": (Di,),
            x + "k_norm.bias": (Di,), x + "weights_proj.weight": (Hi, h), x + "index_kpool_compress_ape": (c.index_kpool, Di),
            x + "index_kpool_compress_gate": (Di, h)}


def _moe_shapes(m: str, c: Glm5NextConfig) -> dict[str, tuple[int, ...]]:
    return moe_layer_shapes(m, c.hidden_size, c.n_routed_experts, c.moe_intermediate_size, c.n_shared_experts)


def _skipped(name: str, config: Glm5NextConfig, notes: set[str], mtp: bool) -> bool:
    """The vision tower of a model built without one, and the multi-token-prediction layer unless
    it drafts: one note each."""
    if name.startswith(VISION_PREFIX):
        notes.add("the vision tower (model.visual.*): serving text only")
        return True
    m = _LAYER.fullmatch(name)
    return bool(m) and skips_mtp_tensor(int(m[1]), m[2], config.num_hidden_layers, mtp, SHARED_COPIES, notes)


def load_released_weights(model: Glm5NextForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy released checkpoint tensors into `model`; returns the names loaded. FP8 weights with
    their `weight_scale_inv` are dequantized first. Unknown names, wrong shapes and missing tensors
    are errors that name them."""
    config = model.config
    notes: set[str] = set()
    dense = FP8_LAYOUT.checkpoint_weights(model, weights)
    mtp = model.mtp is not None
    vision: dict[str, torch.Tensor] | None = {} if model.visual is not None else None
    dense = _vision_tensors_apart(dense, vision)
    loaded = load_released(
        model, dense, released_shapes(config, mtp, model.fp8_block, model.fp8_linear_block is not None, model.fp4_experts),
        family="GLM-5.3-Flash (this config)",
        layer_name=_LAYER,
        skip=lambda name: _skipped(name, config, notes, mtp),
        top_param=lambda name: name if name == "lm_head.weight" else "model." + name.removeprefix(PREFIX),
        layer_tensor=lambda i, layer, rest, tensor, params: _load_layer_tensor(model, layer, i, rest, tensor, params),
        layer_of=lambda i: model.mtp if i == config.num_hidden_layers else model.model.layers[i])
    for note in sorted(notes):
        log.info("GLM-5.3-Flash checkpoint: skipped %s", note)
    if vision is not None:
        loaded |= _load_vision_tower(model, vision)
    return loaded


def _vision_tensors_apart(weights, vision: dict | None):
    """The checkpoint's tensors less the vision tower's, which go into `vision` (its own names ->
    tensor) when the model has a tower (load_released skips them either way)."""
    for name, tensor in weights:
        if vision is not None and name.startswith(VISION_PREFIX):
            vision[name.removeprefix(VISION_PREFIX)] = tensor
            continue
        yield name, tensor


def _load_vision_tower(model: Glm5NextForCausalLM, tensors: dict) -> set[str]:
    """The tower's tensors under the released names (`model.visual.` + the tower's own), every one
    of them (FP8 ones come dequantized: FP8_LAYOUT.checkpoint_weights); none at all: a text-only export,
    served as text (one log line)."""
    if not tensors:
        log.info("GLM-5.3-Flash checkpoint has no vision tower tensors (model.visual.*): serving text only")
        model.visual = None
        return set()
    state = model.visual.state_dict()
    unknown = sorted(set(tensors) - set(state))
    missing = sorted(set(state) - set(tensors))
    if unknown or missing:
        raise ValueError(f"the checkpoint's vision tower does not match its vision_config: "
                         f"{len(missing)} tensors missing (e.g. {[VISION_PREFIX + n for n in missing[:4]]}), "
                         f"{len(unknown)} unknown (e.g. {[VISION_PREFIX + n for n in unknown[:4]]})")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise ValueError(f"checkpoint tensor {VISION_PREFIX}{name} has shape {list(tensor.shape)}; expected "
                             f"{list(state[name].shape)}")
        state[name].copy_(tensor)
    return {VISION_PREFIX + n for n in tensors}


def _load_layer_tensor(model, layer: Glm5NextDecoderLayer, i: int, rest: str, tensor: torch.Tensor, params: dict) -> None:
    e = _EXPERT.fullmatch(rest)
    if e:
        layer.mlp.load_expert(int(e[1]), _EXPERT_PART[e[2]], tensor, piece=e[3])
        return
    hc = _HC.fullmatch(rest)
    if hc:
        getattr(getattr(layer, f"{hc[1]}_hc"), hc[2]).copy_(tensor)
        return
    renamed = {"mlp.gate.weight": "mlp.gate_weight",
               "mlp.gate.e_score_correction_bias": "mlp.e_score_correction_bias"}.get(rest, rest)
    where = "mtp" if layer is model.mtp else f"model.layers.{i}"
    if not load_named_tensor(model, f"{where}.{renamed}", tensor, params):
        raise ValueError(f"{PREFIX}layers.{i}.{rest}: no parameter of the model takes it")


# ---- random weights at any size (tests, `--load-format dummy`) ------------------------------------

def random_released_tensors(config: Glm5NextConfig, seed: int = 0, *, dtype=torch.bfloat16, device="cpu",
                            mtp: bool | None = None):
    """Random tensors under the released names, one at a time, scaled so activations stay O(1) at
    any depth. What transformers' initialisation would leave trivial is randomised (pool `ape`
    and `compress_gate`, hc `base` and `scale`, `A_log`, the correction bias), so a comparison
    exercises every term. `mtp`: with the multi-token-prediction layer (None: when the config has
    one). Yields (name, tensor)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = config.num_hidden_layers
    f32 = torch.float32

    def randn(shape, std, dt=dtype):
        return torch.randn(shape, generator=gen, device=device, dtype=f32).mul_(std).to(dt)

    mtp = config.num_mtp_layers > 0 if mtp is None else mtp
    for name, shape in released_shapes(config, mtp).items():
        if name.endswith(("norm.weight", "k_norm.weight")):
            t = 1.0 + randn(shape, 0.1)
        elif name.endswith("k_norm.bias"):
            t = randn(shape, 0.1)
        elif name.endswith("_conv1d.weight"):
            t = randn(shape, shape[-1] ** -0.5, f32)
        elif name.endswith(".A_log"):
            t = randn(shape, 0.5, f32)
        elif name.endswith(".dt_bias"):
            t = randn(shape, 1.0, f32)
        elif name.endswith("e_score_correction_bias"):
            t = randn(shape, 0.05, f32)
        elif name.endswith("mlp.gate.weight"):
            t = randn(shape, shape[1] ** -0.5, f32)
        elif re.search(r"hc_(attn|ffn)_fn$", name):
            t = randn(shape, shape[1] ** -0.5, f32)
        elif re.search(r"hc_(attn|ffn)_base$", name):
            t = randn(shape, 0.5, f32)
        elif re.search(r"hc_(attn|ffn)_scale$", name):
            t = 1.0 + randn(shape, 0.3, f32)
        elif name.endswith("index_kpool_compress_ape"):
            t = randn(shape, 1.0)
        elif name.endswith("index_kpool_compress_gate"):
            t = randn(shape, shape[1] ** -0.5)
        elif name == PREFIX + "embed_tokens.weight":
            t = randn(shape, 1.0)
        elif name == "lm_head.weight":
            t = randn(shape, 4.0 / shape[1] ** 0.5)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t = randn(shape, 1.0 / (shape[1] * 2 * layers) ** 0.5)
        elif name.endswith("eh_proj.weight"):
            t = randn(shape, shape[1] ** -0.5)
        elif name.endswith(".b_proj.weight"):
            t = randn(shape, 2.0 / shape[1] ** 0.5)
        else:
            t = randn(shape, shape[-1] ** -0.5)
        yield name, t
    if config.vision is not None:
        yield from _random_vision_tensors(config, randn)


def _random_vision_tensors(config: Glm5NextConfig, randn):
    """The vision tower's tensors (`model.visual.*`) at random: norm weights near one, biases
    small, weights scaled by their fan-in."""
    shapes = {name: tuple(t.shape) for name, t in
              Glm5NextVisionTower(config.vision, device="meta").state_dict().items()}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = (1.0 + randn(shape, 0.1)) if "norm" in name and name.endswith("weight") else randn(shape, 0.1)
        else:
            t = randn(shape, math.prod(shape[1:]) ** -0.5)
        yield VISION_PREFIX + name, t


__all__ = ["Glm5NextConfig", "Glm5NextForCausalLM", "load_released_weights", "random_released_tensors",
           "released_shapes"]
