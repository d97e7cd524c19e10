"""Kimi-Linear against transformers 5.23.0 (its pure-torch port, fp32 on the CPU): a tiny random
checkpoint written with the **released** tensor names and config spelling, loaded by both.

Log-probs of every prompt position (the engine's prompt and sample log-probs over the whole
vocabulary) agree to relative RMS <= 1e-4, and 32 greedy tokens are identical: alone, batched,
with chunked prefill, and with a preemption in between."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from family_parity import check_greedy_alone_batched_chunked_preempted, hf_greedy, hf_logprobs, logprob_rows
from safetensors.torch import save_file

from kdaserve.engine import LLM, SamplingParams
from kdaserve.models.kimi_linear import random_released_tensors, released_shapes
from kdaserve.models.kimi_linear_config import KimiLinearConfig
from kdaserve.models.loader import load_model
from kdaserve.testing.compare import rel_rms

VOCAB = 260
# fp32 wherever the engine runs (on a GPU it would default to bf16), as transformers runs on the CPU.
REF = dict(kda_prefill_backend="reference", kda_decode_backend="reference", mla_backend="reference",
           moe_backend="reference", dtype="float32")
PROMPTS = [[72, 101, 108, 108, 111, 32, 75, 68, 65], list(range(40, 77)), [7], [200 + (i * 7) % 50 for i in range(23)]]


def tiny_config(**overrides) -> KimiLinearConfig:
    """Two KDA layers around an MLA layer, then MLA last (as released), dense first layer, MoE after."""
    kw = dict(hidden_size=64, num_hidden_layers=4, vocab_size=VOCAB,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              linear_num_heads=2, linear_head_dim=32, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=16, v_head_dim=16, intermediate_size=96, moe_intermediate_size=32,
              num_local_experts=8, num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=2.446,
              max_position_embeddings=4096, bos_token_id=None, eos_token_id=256, pad_token_id=None, torch_dtype="float32")
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def write_checkpoint(path, config: KimiLinearConfig, seed: int = 3, mutate=None):
    path.mkdir(parents=True, exist_ok=True)
    config.save(path / "config.json")
    tensors = {k: v.contiguous() for k, v in random_released_tensors(config, seed, dtype=torch.float32)}
    if mutate is not None:
        mutate(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("kimi") / "ckpt", tiny_config())


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    return model.eval()


def test_the_config_is_written_in_the_released_spelling(checkpoint):
    d = json.loads((checkpoint / "config.json").read_text())
    assert d["model_type"] == "kimi_linear" and d["architectures"] == ["KimiLinearForCausalLM"]
    assert d["linear_attn_config"]["kda_layers"] == [1, 3] and d["linear_attn_config"]["full_attn_layers"] == [2, 4]
    assert d["num_experts"] == 8 and d["num_experts_per_token"] == 3 and d["moe_renormalize"] is True
    assert KimiLinearConfig.from_dict(d).layer_types == tiny_config().layer_types


def test_log_probs_of_every_position_match_transformers(checkpoint, hf_model):
    llm = LLM(str(checkpoint), max_model_len=256, max_logprobs=VOCAB, **REF)
    for prompt, ours in zip(PROMPTS, logprob_rows(llm, PROMPTS, VOCAB)):
        ref = hf_logprobs(hf_model, prompt)
        assert not ours.isnan().any()
        assert rel_rms(ours, ref) <= 1e-4, (len(prompt), rel_rms(ours, ref))


def test_32_greedy_tokens_match_transformers_alone_batched_chunked_and_preempted(checkpoint, hf_model):
    # 4 prompts growing to 69 tokens want 16 blocks of 16; 9 blocks force preemptions.
    check_greedy_alone_batched_chunked_preempted(str(checkpoint), PROMPTS, [hf_greedy(hf_model, p) for p in PROMPTS], REF)


def test_router_matches_transformers_with_expert_groups():
    """Grouped top-k (4 groups, 2 allowed), correction bias, renormalisation and scaling."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    from kdaserve.ops.moe.router import RouterConfig, route_tokens

    cfg = transformers.KimiLinearConfig(hidden_size=32, num_local_experts=16, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = KimiLinearTopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(16, 32, generator=g)
    router.e_score_correction_bias.data = torch.randn(16, generator=g) * 0.3
    x = torch.randn(50, 32, generator=g)
    _, w_ref, ids_ref = router(x)
    w, ids = route_tokens(x, router.weight, router.e_score_correction_bias, RouterConfig(16, 4, "sigmoid", 4, 2, True, 2.5))
    order_ref, order = ids_ref.argsort(-1), ids.argsort(-1)
    assert torch.equal(ids_ref.gather(1, order_ref), ids.gather(1, order))
    torch.testing.assert_close(w_ref.gather(1, order_ref), w.gather(1, order), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")
def test_triton_paths_in_the_interpreter_give_the_reference_tokens():
    """flash prefill (chunked), fused decode, the MLA kernels and the fused MoE, through the engine."""
    prompts, greedy = ["Hello", "The quick brown fox jumps", "KDA"], SamplingParams(max_tokens=4, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_model_len=64)
    want = [o.output_token_ids for o in LLM("kimi-tiny", **REF, **kw).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM("kimi-tiny", kda_prefill_backend="flash", kda_decode_backend="fused", mla_backend="triton",
              moe_backend="triton", max_num_batched_tokens=12, **kw)
    assert [o.output_token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want


def _load(path):
    return load_model(str(path), dtype=torch.float32, device="cpu", mla_backend="reference", moe_backend="reference")


def test_bad_checkpoints_are_errors_that_name_the_tensor(tmp_path):
    config = tiny_config()
    write_checkpoint(tmp_path / "missing", config, mutate=lambda t: t.pop("model.layers.2.self_attn.f_b_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.2\.self_attn\.f_b_proj"):
        _load(tmp_path / "missing")
    write_checkpoint(tmp_path / "shape", config, mutate=lambda t: t.__setitem__(
        "model.layers.1.self_attn.kv_b_proj.weight", torch.zeros(4 * 32, 31)))
    with pytest.raises(ValueError, match=r"kv_b_proj.weight has shape \[128, 31\]; expected \[128, 32\]"):
        _load(tmp_path / "shape")
    write_checkpoint(tmp_path / "renamed", config, mutate=lambda t: t.__setitem__(
        "model.layers.1.mlp.experts.gate_up_proj", torch.zeros(8, 64, 64)))   # transformers' name, not released
    with pytest.raises(ValueError, match=r"does not have.*mlp\.experts\.gate_up_proj"):
        _load(tmp_path / "renamed")
    (tmp_path / "types").mkdir()
    d = config.to_dict()
    d["layer_types"] = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    (tmp_path / "types" / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"unknown layer types \['sliding_attention'\]"):
        _load(tmp_path / "types")
    d = config.to_dict()
    d["linear_attn_config"]["kda_layers"] = [1, 3, 5]
    (tmp_path / "types" / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"lists layer 5, outside 1..4 \(the lists are 1-based\)"):
        _load(tmp_path / "types")


def test_released_shapes_at_the_real_size():
    """The released architecture: 48B parameters (about 98 GB in bf16), 20 KDA + 7 MLA layers, the
    last one MLA, a dense first layer."""
    from kdaserve.models.builtin import released_config

    c = released_config("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    assert len(c.kda_layer_ids) == 20 and c.attention_layer_ids == [3, 7, 11, 15, 19, 23, 26]
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 27))
    params = sum(torch.Size(s).numel() for s in released_shapes(c).values())
    assert 48.0e9 < params < 49.5e9, params


def _logprobs(llm, prompts):
    return logprob_rows(llm, prompts, VOCAB)


def test_quantization_fp8_keeps_experts_mlps_and_mla_projections_in_fp8(tmp_path, monkeypatch):
    """--quantization fp8 on a full-precision checkpoint: the routed experts, the dense and shared
    MLPs and the MLA projections are quantized at load (the config's 32 x 32 blocks) and run as
    block-scaled FP8 GEMMs (the interpreter here), equal to the same weights released in FP8, and
    within a few percent of the full-precision model (FP8 activations are the difference)."""
    import triton

    from kdaserve.models.kimi_linear import keeps_fp8
    from kdaserve.ops.fp8.reference import FP8, quantize_blocks

    if not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    config = tiny_config(extra={"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}})
    full = write_checkpoint(tmp_path / "full", config)

    def release_in_fp8(tensors):
        for name in [n for n in tensors if keeps_fp8(config, n, True)]:
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensors[name], (32, 32))

    released = write_checkpoint(tmp_path / "fp8", config, mutate=release_in_fp8)
    kw = dict(max_model_len=128, max_logprobs=VOCAB, warmup=False, **{**REF, "moe_backend": "triton"})
    llm = LLM(str(full), quantization="fp8", **kw)
    layers = llm.engine.runner.model.model.layers
    assert layers[1].block_sparse_moe.w13.dtype == FP8 and layers[1].self_attn.q_proj.weight.dtype == FP8
    assert layers[0].mlp.down_proj.weight.dtype == FP8 and layers[1].block_sparse_moe.shared_experts.down_proj.weight.dtype == FP8
    assert layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
    quantized = _logprobs(llm, PROMPTS[:2])
    monkeypatch.setenv("KDASERVE_FP8_WEIGHTS", "keep")
    as_released = _logprobs(LLM(str(released), **kw), PROMPTS[:2])
    monkeypatch.delenv("KDASERVE_FP8_WEIGHTS")
    plain = _logprobs(LLM(str(full), **kw), PROMPTS[:2])
    for q, r, p in zip(quantized, as_released, plain):
        assert rel_rms(q, r) < 1e-4, "quantized at load vs released in FP8"
        assert rel_rms(q, p) < 0.035, "FP8 vs full precision (log-probs)"
