"""Built-in models: fixed configurations with deterministic random weights (no download) and the
byte-level tokenizer.

- `tiny`: runs on a CPU in seconds (tests, the README's main job without a GPU).
- `bench`: KDA layers at GLM-5.3-Flash's per-GPU shape under 2-way tensor parallelism (32 heads of
  128, hidden 4096) with every 4th layer full attention; 8 layers keep GPU benchmarks fast.
- `kimi-tiny`: the Kimi-Linear family (KDA with the unbounded gate, MLA, MoE) at a CPU size.
- `glm-tiny`: the GLM-5.3-Flash family (bounded gate, DSA, hyper-connections) at a CPU size, with a
  tiny vision tower (its byte tokenizer has the image placeholder `<|image|>` and its brackets).
- `ling-tiny`: the Ling-3 family (full-rank KDA gates, gated MLA with interleaved RoPE, grouped
  routing, an MTP layer) at a CPU size.
- `nano`: a trained checkpoint shipped in the package (kdaserve/models/nano: the Kimi-Linear
  family, 6.6M parameters, trained on Python's standard library with tools/train_nano.py; recipe
  and curve in docs/evidence.md). Loaded like any checkpoint directory; the README's default.
- released names (`moonshotai/Kimi-Linear-48B-A3B-Instruct`, `-Base`, `zai-org/GLM-5.3-Flash`,
  `inclusionAI/Ling-3.0-Flash`): the released architecture,
  for `--load-format dummy` (random weights at the real shape) when no checkpoint is at hand.
"""

from __future__ import annotations

from pathlib import Path

from kdaserve.models.hybrid_config import HybridConfig
from kdaserve.models.tokenizer import ByteTokenizer

_BYTE_VOCAB = ByteTokenizer().vocab_size

# Trained checkpoints shipped inside the package, by name: loaded exactly as a checkpoint directory.
SHIPPED_CHECKPOINTS: dict[str, Path] = {"nano": Path(__file__).parent / "nano"}


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


def builtin_config(name: str):
    """A built-in model's configuration (random weights, byte tokenizer): a fresh copy callers may modify."""
    c = BUILTIN_CONFIGS.get(name) or FAMILY_BUILTIN_CONFIGS.get(name)
    if c is None:
        raise ValueError(f"unknown built-in model {name!r}; expected one of "
                         f"{sorted(BUILTIN_CONFIGS) + sorted(FAMILY_BUILTIN_CONFIGS)} or a checkpoint directory")
    return type(c).from_dict(c.to_dict())


# ---- Kimi-Linear: a tiny built-in for tests and CPU runs, and the released shapes ------------------

def _kimi_configs():
    from kdaserve.models.kimi_linear_config import KimiLinearConfig

    tiny = KimiLinearConfig(
        hidden_size=64, num_hidden_layers=4, vocab_size=_BYTE_VOCAB,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_heads=2, linear_head_dim=32, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=1,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
        max_position_embeddings=8192, bos_token_id=None, eos_token_id=ByteTokenizer().eos_token_id, pad_token_id=None,
        torch_dtype="float32", model_type="kimi_linear",
    )
    # Kimi-Linear-48B-A3B (Instruct and Base share the architecture): the released config.json's values.
    kda = [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]
    released = KimiLinearConfig.from_dict({
        "model_type": "kimi_linear", "hidden_size": 2304, "num_hidden_layers": 27, "vocab_size": 163840,
        "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_attention_heads": 32, "num_key_value_heads": 32,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1, "rms_norm_eps": 1e-5,
        "model_max_length": 1048576, "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163586,
        "pad_token_id": 163839, "torch_dtype": "bfloat16",
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32,
                               "head_dim": 128, "short_conv_kernel_size": 4},
    })
    return {"kimi-tiny": tiny}, {
        "moonshotai/Kimi-Linear-48B-A3B-Instruct": released, "moonshotai/Kimi-Linear-48B-A3B-Base": released,
    }


def _glm_configs():
    from kdaserve.models.glm5_next_config import Glm5NextConfig

    # A tiny vision tower beside it (images through the engine and the API on a CPU); the byte
    # vocabulary gains the image placeholder and its brackets (ByteTokenizer(image_tokens=True)).
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
              "projection_intermediate_size": 64, "patch_size": 14}
    tiny = Glm5NextConfig(
        hidden_size=64, num_hidden_layers=4, vocab_size=_BYTE_VOCAB + 4,   # + 1 unused: 264 splits over 2, 4, 8 ranks
        layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        linear_num_heads=2, linear_head_dim=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_topk=64, index_head_dim=16, index_n_heads=4,
        index_kpool=8, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        max_position_embeddings=8192, eos_token_id=ByteTokenizer().eos_token_id, pad_token_id=None,
        torch_dtype="float32", extra={"num_nextn_predict_layers": 1,   # an MTP layer, as released
                                      "vision_config": vision, "outer_config": {"image_token_id": _BYTE_VOCAB + 1}},
    )
    # GLM-5.3-Flash as transformers 5.23.0 describes it (no released config.json on this machine to
    # confirm against): 45 layers (34 KDA, 11 DSA), 288 experts, one MTP layer.
    released = Glm5NextConfig.from_dict({"model_type": "glm5_next_text", "num_nextn_predict_layers": 1})
    return {"glm-tiny": tiny}, {"zai-org/GLM-5.3-Flash": released}


def _ling_configs():
    from kdaserve.models.bailing_hybrid_config import BailingHybridConfig

    # MLA every third layer (layer_group_size 3), two dense layers, 16 experts in 4 groups (2 chosen).
    tiny = BailingHybridConfig(
        hidden_size=64, num_hidden_layers=6, vocab_size=_BYTE_VOCAB, layer_group_size=3, first_k_dense_replace=1,
        linear_head_dim=32, num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_local_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, max_position_embeddings=8192, eos_token_id=ByteTokenizer().eos_token_id,
        pad_token_id=None, torch_dtype="float32", num_mtp_layers=1,
    )
    # Ling-3.0-Flash as transformers 5.23.0 describes it (its BailingHybridConfig defaults; no released
    # config.json on this machine to confirm against): 42 layers (35 KDA, 7 MLA), 512 experts top-8.
    released = BailingHybridConfig()
    return {"ling-tiny": tiny}, {"inclusionAI/Ling-3.0-Flash": released}


FAMILY_BUILTIN_CONFIGS, RELEASED_CONFIGS = _kimi_configs()
for _builtin, _released in (_glm_configs(), _ling_configs()):
    FAMILY_BUILTIN_CONFIGS.update(_builtin)
    RELEASED_CONFIGS.update(_released)


def released_config(name: str):
    """The architecture of a released model by its Hugging Face name (with or without the
    organisation), or None; a copy callers may modify."""
    for full, config in RELEASED_CONFIGS.items():
        if name in (full, full.split("/", 1)[1]):
            return type(config).from_dict(config.to_dict())
    return None
