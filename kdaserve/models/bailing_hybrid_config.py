"""Ling-3's configuration (inclusionAI, `model_type: bailing_hybrid`), parsed from the released
`config.json` as transformers 5.23.0 reads it.

The file spells several settings its own way and transformers maps them (its `attribute_map`):
`num_experts`, `num_experts_per_token`, `num_shared_experts`, `moe_renormalize`, `num_expert_group`,
`model_max_length`, `num_nextn_predict_layers`; the transformers names (`num_local_experts`,
`num_experts_per_tok`, `n_shared_experts`, `norm_topk_prob`, `n_group`, `max_position_embeddings`,
`num_mtp_layers`) are read too. `head_dim` is the **KDA** head size (transformers copies it to
`linear_head_dim` and then reuses `head_dim` for the rotary size, `qk_rope_head_dim`): a file that
carries `linear_head_dim` (transformers' own save) is read by it. KDA layers have as many heads as
MLA layers (`num_attention_heads`). Layer kinds: MLA where `(i + 1) % layer_group_size == 0`, KDA
elsewhere, unless `layer_types` lists them; the first `first_k_dense_replace` layers dense, unless
`mlp_layer_types` lists them. Unknown keys are kept in `extra`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kdaserve.models.hybrid_config import JsonConfig
from kdaserve.ops.moe.router import RouterConfig

MODEL_TYPE = "bailing_hybrid"
# The released spelling -> the field (transformers' attribute_map, reversed).
_ALIASES = {
    "num_experts": "num_local_experts", "n_routed_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group", "model_max_length": "max_position_embeddings",
    "num_nextn_predict_layers": "num_mtp_layers", "short_conv_kernel_size": "linear_conv_kernel_dim",
}
_LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass
class BailingHybridConfig(JsonConfig):
    hidden_size: int = 2560
    num_hidden_layers: int = 42
    vocab_size: int = 157184
    layer_group_size: int = 6
    layer_types: list[str] | None = None       # "linear_attention" (KDA) / "full_attention" (MLA)
    mlp_layer_types: list[str] | None = None   # "dense" / "sparse"
    first_k_dense_replace: int = 2
    # KDA (heads: num_attention_heads)
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    # gated MLA with interleaved partial RoPE
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 6_000_000.0
    rope_parameters: dict | None = None
    attention_bias: bool = False
    # MLP and MoE
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_local_experts: int = 512
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    hidden_act: str = "silu"
    num_mtp_layers: int = 1
    # shared
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 156895
    pad_token_id: int | None = 156892
    torch_dtype: str | None = "bfloat16"
    model_type: str = MODEL_TYPE
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_group_size < 1:
            raise ValueError(f"layer_group_size must be >= 1, got {self.layer_group_size}")
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % self.layer_group_size == 0 else "linear_attention"
                                for i in range(n)]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)]
        for name, values, allowed in (("layer_types", self.layer_types, _LAYER_KINDS),
                                      ("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse"))):
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries; expected num_hidden_layers = {n}")
            if wrong := sorted(set(values) - set(allowed)):
                raise ValueError(f"{name} holds {wrong}; Ling-3 layers are {' or '.join(allowed)}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                             f"({self.num_attention_heads}) for MLA")
        rope = self.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.rope_type {rope['rope_type']!r}: kdaserve implements Ling-3's "
                             f"default rotary embedding only (no scaling)")
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and positive (Ling-3 rotates it), got {self.qk_rope_head_dim}")
        if self.kda_safe_gate and not -5.0 <= self.kda_lower_bound < 0:
            raise ValueError(f"kda_lower_bound must lie in [-5, 0) for the bounded (safe) gate, got {self.kda_lower_bound}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: only silu is implemented (SwiGLU, the KDA conv's SiLU)")
        if self.attention_bias:
            raise ValueError("attention_bias = true: Ling-3's released attention has no biases; not implemented")
        self.router  # validates the expert counts and groups

    # ---- derived --------------------------------------------------------------------------------

    @property
    def linear_num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def linear_lower_bound(self) -> float | None:
        """The bounded gate's lower bound, or None for the unbounded gate (kda_safe_gate false)."""
        return self.kda_lower_bound if self.kda_safe_gate else None

    @property
    def linear_round_gate(self) -> bool:
        """transformers' Ling-3 casts the KDA gate to the activation dtype before the core (Kimi-Linear
        and GLM keep it fp32): the kernels round it likewise (KDAWeights.round_gate)."""
        return True

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    @property
    def router(self) -> RouterConfig:
        return RouterConfig(self.num_local_experts, self.num_experts_per_tok, "sigmoid", self.n_group, self.topk_group,
                            self.norm_topk_prob, self.routed_scaling_factor)

    # ---- config.json ----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict) -> "BailingHybridConfig":
        d = dict(d)
        for src, dst in _ALIASES.items():
            if src in d:
                value = d.pop(src)
                d.setdefault(dst, value)
        # head_dim is the KDA head size in the released file; transformers' own save writes the
        # rotary size there and the KDA size as linear_head_dim.
        head_dim = d.pop("head_dim", None)
        if head_dim is not None:
            d.setdefault("linear_head_dim", head_dim)
        for derived in ("linear_num_heads", "qk_head_dim"):   # transformers' derived values, not settings
            d.pop(derived, None)
        if d.get("rope_scaling"):
            d.setdefault("rope_parameters", d["rope_scaling"])
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names and k != "model_type"}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        """config.json in the released spelling (what the tests write; transformers reads it)."""
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        released = {dst: src for src, dst in _ALIASES.items() if src not in ("n_routed_experts",)}
        out = {released.get(k, k): v for k, v in d.items()}
        out["head_dim"] = out.pop("linear_head_dim")
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.q_lora_rank is None:
            out.pop("q_lora_rank")
        out.update(extra)
        return out
