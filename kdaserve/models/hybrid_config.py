"""The hybrid model's configuration, with the field names of GLM-5.3-Flash-style checkpoints
(`config.json`) where they exist. Unknown keys of a checkpoint's config are kept in `extra`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

LAYER_TYPES = ("linear_attention", "full_attention")


class JsonConfig:
    """`from_json` / `save` for a config class with `from_dict` / `to_dict` (config.json's spelling)."""

    @classmethod
    def from_json(cls, path: str | Path):
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass
class HybridConfig(JsonConfig):
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    # KDA ("linear_attention") layers
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0     # None: Kimi-Linear's unbounded gate
    # full-attention layers
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 128
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # shared
    intermediate_size: int = 1024
    vocab_size: int = 32000
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    model_type: str = "kda_hybrid"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries; expected num_hidden_layers = {self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"unknown layer_types {bad}; expected each to be one of {LAYER_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: dict) -> "HybridConfig":
        d = dict(d)
        d = d.get("text_config", d) if "hidden_size" not in d else d
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        missing = [n for n in ("hidden_size", "num_hidden_layers", "layer_types", "linear_num_heads",
                               "linear_head_dim") if n not in d]
        if missing:
            raise ValueError(f"config is missing {missing}; a hybrid KDA config needs them")
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(d.pop("extra"))
        return d

