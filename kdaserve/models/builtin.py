"""Built-in models: fixed configurations with deterministic random weights (no download) and the
byte-level tokenizer.

- `tiny`: runs on a CPU in seconds (tests, the README's main job without a GPU).
- `bench`: KDA layers at GLM-5.3-Flash's per-GPU shape under 2-way tensor parallelism (32 heads of
  128, hidden 4096) with every 4th layer full attention; 8 layers keep GPU benchmarks fast.
"""

from __future__ import annotations

from kdaserve.models.config import HybridConfig
from kdaserve.models.tokenizer import ByteTokenizer

_BYTE_VOCAB = ByteTokenizer().vocab_size


def _every_nth_full(num_layers: int, n: int) -> list[str]:
    return ["full_attention" if i % n == n - 1 else "linear_attention" for i in range(num_layers)]


BUILTIN_CONFIGS: dict[str, HybridConfig] = {
    "tiny": HybridConfig(
        hidden_size=64, num_hidden_layers=4, layer_types=_every_nth_full(4, 2),
        linear_num_heads=2, linear_head_dim=32, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=_BYTE_VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=8192, eos_token_id=ByteTokenizer().eos_token_id, model_type="kda_hybrid_tiny",
    ),
    "bench": HybridConfig(
        hidden_size=4096, num_hidden_layers=8, layer_types=_every_nth_full(8, 4),
        linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        vocab_size=_BYTE_VOCAB, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        max_position_embeddings=32768, eos_token_id=ByteTokenizer().eos_token_id, model_type="kda_hybrid_bench",
    ),
}


def builtin_config(name: str) -> HybridConfig:
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"unknown built-in model {name!r}; expected one of {sorted(BUILTIN_CONFIGS)} or a checkpoint directory")
    c = BUILTIN_CONFIGS[name]
    return HybridConfig.from_dict(c.to_dict())   # a fresh copy callers may modify
