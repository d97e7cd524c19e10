"""GLM-5.3-Flash's configuration (`model_type: glm5_next`, text part `glm5_next_text`).

The released `config.json` nests the text model under `text_config` beside the vision tower's
`vision_config` (kept in `extra`, read by `vision`; the image token ids are the outer config's); a
flat text-only file is accepted too. KDA sizes may come only nested in
`linear_attn_config` (num_heads, head_dim, short_conv_kernel_size, gate_lower_bound and **0-based**
`kda_layers` / `full_attn_layers`). Attention layers are MLA with the DSA indexer; their type is
spelled `indexed_attention` (transformers), `deepseek_sparse_attention` or `full_attention`, all
read as "indexed_attention". Keys only vLLM reads (`mhc`, `mla_use_nope`, `topk_method`,
`scoring_func`, `moe_router_dtype`, `num_nextn_predict_layers`, ...) are kept in `extra`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kdaserve.models.hybrid_config import JsonConfig
from kdaserve.ops.moe.router import RouterConfig

MODEL_TYPES = ("glm5_next", "glm5_next_text")
ATTENTION = "indexed_attention"
_ATTENTION_SPELLINGS = ("indexed_attention", "deepseek_sparse_attention", "full_attention")
_ALIASES = {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts"}


@dataclass
class Glm5NextConfig(JsonConfig):
    hidden_size: int = 4096
    num_hidden_layers: int = 45
    vocab_size: int = 154880
    layer_types: list[str] | None = None      # 0-based; default: attention where i % 4 == 3
    mlp_layer_types: list[str] | None = None  # "dense" / "sparse"; default: the first 3 dense
    indexer_types: list[str] | None = None    # "full" (own indexer) / "shared" (the previous full layer's choice)
    # KDA
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float = -5.0
    # MLA (no rotary) with q-LoRA
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    attention_bias: bool = False
    # DSA indexer
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    # hyper-connections
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # MLP and MoE (clamped SwiGLU everywhere)
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    # shared
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = 154820
    torch_dtype: str | None = "bfloat16"
    model_type: str = "glm5_next_text"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [ATTENTION if i % 4 == 3 else "linear_attention" for i in range(n)]
        bad = sorted({t for t in self.layer_types if t != "linear_attention" and t not in _ATTENTION_SPELLINGS})
        if bad:
            raise ValueError(f"unknown layer types {bad}; GLM-5.3-Flash layers are linear_attention (KDA) or "
                             f"indexed_attention (MLA with the DSA indexer; also spelled {', '.join(_ATTENTION_SPELLINGS[1:])})")
        self.layer_types = [t if t == "linear_attention" else ATTENTION for t in self.layer_types]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        for name, values, allowed in (("layer_types", self.layer_types, None),
                                      ("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse")),
                                      ("indexer_types", self.indexer_types, ("full", "shared"))):
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries; expected num_hidden_layers = {n}")
            if allowed and (wrong := sorted(set(values) - set(allowed))):
                raise ValueError(f"{name} holds {wrong}; expected only {list(allowed)}")
        for i, kind in enumerate(self.indexer_types):
            # A shared layer reuses the selection the layer right before it made (as transformers and the
            # released model pass it on): that layer must be an attention layer with its own indexer.
            if kind == "shared" and self.layer_types[i] == ATTENTION and not (
                    i > 0 and self.layer_types[i - 1] == ATTENTION and self.indexer_types[i - 1] == "full"):
                raise ValueError(f"layer {i} is 'shared' in indexer_types but layer {i - 1} is not an attention layer "
                                 f"with a full indexer: a shared layer reuses the selection of the layer right before it")
        if self.qk_rope_head_dim != 0:
            raise ValueError(f"qk_rope_head_dim = {self.qk_rope_head_dim}: GLM-5.3-Flash's attention uses no rotary "
                             f"embedding (0 expected)")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                             f"({self.num_attention_heads}) for MLA")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise ValueError(f"index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool}) >= 1")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise ValueError(f"hc_mult ({self.hc_mult}) and hc_sinkhorn_iters ({self.hc_sinkhorn_iters}) must be >= 1")
        if not self.linear_lower_bound < 0:
            raise ValueError(f"linear_lower_bound must be negative (GLM's bounded gate; -5 as released), "
                             f"got {self.linear_lower_bound}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: only silu (clamped SwiGLU) is implemented")
        self.router  # validates the expert counts

    # ---- derived --------------------------------------------------------------------------------

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == ATTENTION]

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    @property
    def router(self) -> RouterConfig:
        return RouterConfig(self.n_routed_experts, self.num_experts_per_tok, "sigmoid", self.n_group, self.topk_group,
                            self.norm_topk_prob, self.routed_scaling_factor)

    @property
    def vision(self):
        """The vision tower's config (models/glm5_next_vision.py), or None for a text-only config."""
        from kdaserve.models.glm5_next_vision import Glm5NextVisionConfig

        d = self.extra.get("vision_config")
        return Glm5NextVisionConfig.from_dict(d) if isinstance(d, dict) else None

    @property
    def image_token_id(self) -> int:
        """The image placeholder token (the outer config's; transformers' default as released)."""
        return int(self.extra.get("image_token_id", self.extra.get("outer_config", {}).get("image_token_id", 154854)))

    @property
    def num_mtp_layers(self) -> int:
        return int(self.extra.get("num_nextn_predict_layers", 0) or 0)

    # ---- config.json ----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict) -> "Glm5NextConfig":
        """A released (nested under text_config) or flat config.json."""
        outer = {}
        vision = d.get("vision_config")
        if isinstance(d.get("text_config"), dict):
            outer = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
            d = {**{k: v for k, v in outer.items() if k in ("eos_token_id", "bos_token_id", "pad_token_id",
                                                            "tie_word_embeddings", "torch_dtype")}, **d["text_config"]}
        d = {_ALIASES.get(k, k): v for k, v in d.items()}
        lin = d.pop("linear_attn_config", None) or {}
        for src, dst in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
                         ("short_conv_kernel_size", "linear_conv_kernel_dim"), ("gate_lower_bound", "linear_lower_bound")):
            if lin.get(src) is not None:
                d.setdefault(dst, lin[src])
        if d.get("layer_types") is None and ("kda_layers" in lin or "full_attn_layers" in lin):
            d["layer_types"] = _layer_types_from_0_based(lin, d.get("num_hidden_layers", cls.num_hidden_layers))
        if d.get("linear_lower_bound", -5.0) is None:
            raise ValueError("linear_lower_bound (gate_lower_bound) is null: GLM-5.3-Flash uses the bounded gate")
        d.pop("head_dim", None)   # transformers derives it (the rope dim); not a setting
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k != "model_type"}
        if lin:
            extra["linear_attn_config"] = lin
        if outer:
            extra["outer_config"] = outer
        if isinstance(vision, dict):
            extra["vision_config"] = vision
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        """A flat config.json in transformers' spelling (what the tests write): the text model's
        fields, plus the vision tower's config and image token where the config has a tower."""
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        d.update({k: v for k, v in extra.items() if k not in ("outer_config", "vision_config")})
        if self.vision is not None:
            d["vision_config"] = extra["vision_config"]
            d["image_token_id"] = self.image_token_id
        return d


def _layer_types_from_0_based(lin: dict, n: int) -> list[str]:
    kda, full = lin.get("kda_layers") or [], lin.get("full_attn_layers") or []
    types: list[str | None] = [None] * n
    for kind, layers in (("linear_attention", kda), (ATTENTION, full)):
        for layer in layers:
            if not 0 <= layer < n:
                raise ValueError(f"linear_attn_config lists layer {layer}, outside 0..{n - 1} (GLM's lists are 0-based)")
            if types[layer] is not None:
                raise ValueError(f"layer {layer} is listed both as a KDA and an attention layer")
            types[layer] = kind
    unset = [i for i, t in enumerate(types) if t is None]
    if unset:
        raise ValueError(f"layers {unset} (0-based) are in neither kda_layers nor full_attn_layers")
    return types  # type: ignore[return-value]
