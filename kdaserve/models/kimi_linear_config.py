"""Kimi-Linear's configuration, parsed from the released `config.json` (`model_type: kimi_linear`).

The released file spells several settings its own way (`num_experts`, `num_experts_per_token`,
`num_shared_experts`, `moe_renormalize`, `num_expert_group`, `model_max_length`) and lists the
layer kinds in `linear_attn_config` **1-based** (`kda_layers`, `full_attn_layers`); transformers'
port writes the same settings as `num_local_experts`, `num_experts_per_tok`, ..., `layer_types`.
Both spellings are read. Unknown keys are kept in `extra`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kdaserve.models.hybrid_config import JsonConfig
from kdaserve.ops.moe.router import RouterConfig

MODEL_TYPE = "kimi_linear"
# Released name -> transformers' name (either may appear in a config.json).
_ALIASES = {
    "num_experts": "num_local_experts", "n_routed_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group", "model_max_length": "max_position_embeddings",
}


@dataclass
class KimiLinearConfig(JsonConfig):
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    layer_types: list[str]                 # 0-based: "linear_attention" (KDA) or "full_attention" (MLA)
    # KDA
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # MLA
    num_attention_heads: int = 32
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    # MLP and MoE
    intermediate_size: int = 9216          # the dense layers
    moe_intermediate_size: int = 1024
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.446
    moe_router_activation_func: str = "sigmoid"
    # shared
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586
    pad_token_id: int | None = 163839
    torch_dtype: str | None = "bfloat16"
    model_type: str = MODEL_TYPE
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries; expected num_hidden_layers = "
                             f"{self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in ("linear_attention", "full_attention")})
        if bad:
            raise ValueError(f"unknown layer types {bad}; Kimi-Linear layers are linear_attention (KDA) or "
                             f"full_attention (MLA)")
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope = false (rotary MLA) is not supported yet; Kimi-Linear's released "
                             "checkpoints use no rotary embedding (mla_use_nope = true)")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError(f"moe_router_activation_func must be sigmoid or softmax, got {self.moe_router_activation_func!r}")
        self.router  # validates the expert counts

    # ---- derived --------------------------------------------------------------------------------

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_lower_bound(self) -> None:
        """Kimi-Linear's KDA gate is the unbounded one (softplus), as the other families' None."""
        return None

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def router(self) -> RouterConfig:
        return RouterConfig(self.num_local_experts, self.num_experts_per_tok, self.moe_router_activation_func,
                            self.n_group, self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)

    # ---- config.json ----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict) -> "KimiLinearConfig":
        d = {_ALIASES.get(k, k): v for k, v in d.items()}
        lin = d.pop("linear_attn_config", None) or {}
        for src, dst in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
                         ("short_conv_kernel_size", "linear_conv_kernel_dim")):
            if src in lin:
                d.setdefault(dst, lin[src])
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"Kimi-Linear config.json is missing {missing}")
        n = d["num_hidden_layers"]
        if d.get("layer_types") is None:
            d["layer_types"] = _layer_types_from_1_based(lin, n)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        if lin:
            extra["linear_attn_config"] = lin
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        """The released spelling: KDA sizes and the 1-based layer lists under linear_attn_config."""
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        layer_types = d.pop("layer_types")
        lin = dict(extra.pop("linear_attn_config", {}))
        lin.update(num_heads=d.pop("linear_num_heads"), head_dim=d.pop("linear_head_dim"),
                   short_conv_kernel_size=d.pop("linear_conv_kernel_dim"),
                   kda_layers=[i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
                   full_attn_layers=[i + 1 for i, t in enumerate(layer_types) if t == "full_attention"])
        released = {v: k for k, v in _ALIASES.items() if k not in ("n_routed_experts",)}
        out = {released.get(k, k): v for k, v in d.items()}
        out["linear_attn_config"] = lin
        out["architectures"] = ["KimiLinearForCausalLM"]
        out.update(extra)
        return out


def _layer_types_from_1_based(lin: dict, n: int) -> list[str]:
    kda, full = lin.get("kda_layers"), lin.get("full_attn_layers")
    if kda is None or full is None:
        raise ValueError("Kimi-Linear config.json needs layer_types or linear_attn_config.kda_layers and "
                         ".full_attn_layers (1-based layer numbers)")
    types: list[str | None] = [None] * n
    for kind, layers in (("linear_attention", kda), ("full_attention", full)):
        for layer in layers:
            if not 1 <= layer <= n:
                raise ValueError(f"linear_attn_config lists layer {layer}, outside 1..{n} (the lists are 1-based)")
            if types[layer - 1] is not None:
                raise ValueError(f"layer {layer} is listed both as a KDA and a full-attention layer")
            types[layer - 1] = kind
    unset = [i + 1 for i, t in enumerate(types) if t is None]
    if unset:
        raise ValueError(f"layers {unset} (1-based) are in neither kda_layers nor full_attn_layers")
    return types  # type: ignore[return-value]
