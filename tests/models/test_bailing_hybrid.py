"""Ling-3 (`bailing_hybrid`) against transformers 5.23.0 (`BailingHybridForCausalLM`, fp32 on the CPU):
a tiny random checkpoint written with the **released** tensor names and config keys, loaded by both.
What transformers' initialisation leaves trivial (A_log, dt_bias, expert_bias) is randomised, so a
missing term shows. Two configs: the bounded (safe) gate and the unbounded one. Log-probs of every
position within relative RMS 1e-4 on prompts of 5 to 70 tokens, and 32 greedy tokens identical
alone, batched, with chunked prefill and with a preemption. Each new piece, broken on purpose,
moves the log-probs far from transformers' (the guards below)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from family_parity import (
    check_greedy_alone_batched_chunked_preempted,
    drafts_after_each_step,
    hf_greedy,
    hf_logprobs,
    logprob_rows,
)
from safetensors.torch import load_file, save_file

from kdaserve.engine import LLM, SamplingParams
from kdaserve.models.bailing_hybrid import random_released_tensors, released_shapes
from kdaserve.models.bailing_hybrid_config import BailingHybridConfig
from kdaserve.testing.compare import rel_rms

VOCAB = 260
REF = dict(kda_prefill_backend="reference", kda_decode_backend="reference", mla_backend="reference",
           moe_backend="reference", dtype="float32")
PROMPTS = [[72, 101, 108, 108, 111], list(range(40, 110)), [200 + (i * 7) % 50 for i in range(23)],
           [72, 101, 108, 108, 111, 32, 75, 68, 65]]


def tiny_config(**overrides) -> BailingHybridConfig:
    """KDA, KDA, MLA, KDA, KDA, MLA (layer_group_size 3); a dense first layer; 16 experts in 4 groups,
    2 groups chosen, top 4. The KDA head (32) differs from the rotary size (16) and v (24) from nope
    (16), so a mixed-up size shows."""
    kw = dict(hidden_size=64, num_hidden_layers=6, vocab_size=VOCAB, layer_group_size=3, first_k_dense_replace=1,
              linear_head_dim=32, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
              v_head_dim=24, intermediate_size=96, moe_intermediate_size=32, num_local_experts=16, num_experts_per_tok=4,
              n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_theta=10000.0, max_position_embeddings=4096,
              eos_token_id=256, pad_token_id=None, torch_dtype="float32", num_mtp_layers=0)
    kw.update(overrides)
    return BailingHybridConfig(**kw)


def write_checkpoint(path, config: BailingHybridConfig, seed: int = 3, mutate=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["BailingHybridForCausalLM"]}))
    tensors = {k: v.contiguous() for k, v in random_released_tensors(config, seed, dtype=torch.float32)}
    if mutate is not None:
        mutate(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module", params=["bounded", "unbounded"])
def case(request, tmp_path_factory):
    config = tiny_config(kda_safe_gate=request.param == "bounded")
    ckpt = write_checkpoint(tmp_path_factory.mktemp("ling") / "ckpt", config)
    hf = transformers.BailingHybridForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    assert hf.config.linear_head_dim == 32 and hf.config.head_dim == 16 and hf.config.num_local_experts == 16
    return request.param, ckpt, hf


def test_log_probs_of_every_position_match_transformers(case):
    _, ckpt, hf = case
    llm = LLM(str(ckpt), max_model_len=256, max_logprobs=VOCAB, **REF)
    for prompt, ours in zip(PROMPTS, logprob_rows(llm, PROMPTS, VOCAB)):
        assert not ours.isnan().any()
        assert rel_rms(ours, hf_logprobs(hf, prompt)) <= 1e-4, (len(prompt), rel_rms(ours, hf_logprobs(hf, prompt)))


def _break_rotate_half(model):
    model.model.layers[2].self_attn.rotary.interleaved = False   # the table is shared: every MLA layer


def _break_head_gate(model):
    for layer in model.model.layers:
        if not layer.is_kda:
            layer.self_attn.g_proj = None


def _break_group_limit(model):
    for layer in model.model.layers:
        if layer.is_moe:
            layer.mlp.router = dataclasses.replace(layer.mlp.router, num_groups=1, topk_groups=1)


def _break_correction_bias(model):
    for layer in model.model.layers:
        if layer.is_moe:
            layer.mlp.e_score_correction_bias.zero_()


def _break_rope_position(model):
    """RoPE on every position as if it were the first (a rotary that ignores positions)."""
    rotary = model.model.layers[2].self_attn.rotary
    rotary.cos_sin_cache.copy_(rotary.cos_sin_cache[:1].expand_as(rotary.cos_sin_cache).clone())


@pytest.mark.parametrize("broken", [_break_rotate_half, _break_head_gate, _break_group_limit, _break_correction_bias,
                                    _break_rope_position], ids=lambda f: f.__name__.removeprefix("_break_"))
def test_each_new_piece_broken_moves_the_log_probs_away_from_transformers(case, broken):
    """Guards the comparison above: it sees rotate-half pairs instead of interleaved ones, a missing
    head gate, routing without the group limit, a missing correction bias and unrotated keys."""
    kind, ckpt, hf = case
    if kind != "bounded":
        pytest.skip("one gate is enough")
    llm = LLM(str(ckpt), max_model_len=256, max_logprobs=VOCAB, **REF)
    with torch.no_grad():
        broken(llm.engine.runner.model)
    ours = logprob_rows(llm, [PROMPTS[1]], VOCAB)[0]
    assert rel_rms(ours, hf_logprobs(hf, PROMPTS[1])) > 1e-3


def test_32_greedy_tokens_match_transformers_alone_batched_chunked_and_preempted(case):
    kind, ckpt, hf = case
    if kind != "bounded":
        pytest.skip("the released gate; the unbounded one is checked by the log-probs above")
    check_greedy_alone_batched_chunked_preempted(str(ckpt), PROMPTS, [hf_greedy(hf, p) for p in PROMPTS], REF,
                                                 tight_max_model_len=112)


def test_the_gate_is_rounded_to_the_activation_dtype_as_transformers_does():
    """transformers' BailingHybridForgetGate returns the gate in the hidden states' dtype: in bf16 the
    reference gate with the layer's gate_dtype equals it bit for bit (and the fp32 gate does not);
    a bf16 Ling model asks its kernels to round (KDAWeights.gate_dtype), Kimi-Linear's does not."""
    from kdaserve.ops.kda.reference import kda_gate

    config = transformers.BailingHybridConfig(hidden_size=64, num_attention_heads=2, head_dim=32, num_hidden_layers=2,
                                              num_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2)
    torch.manual_seed(0)
    hf_gate = transformers.models.bailing_hybrid.modeling_bailing_hybrid.BailingHybridForgetGate(config)
    with torch.no_grad():
        hf_gate.f_proj.weight.normal_(0, 0.3)
        hf_gate.A_log.copy_(torch.rand(2).mul(15).add(1).log())
        hf_gate.dt_bias.normal_()
    hf_gate.f_proj.to(torch.bfloat16)
    x = torch.randn(1, 7, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = hf_gate(x)[0]
        logits = torch.nn.functional.linear(x[0], hf_gate.f_proj.weight).view(7, 2, 32)
    assert want.dtype == torch.bfloat16
    ours = kda_gate(logits, hf_gate.A_log.data, hf_gate.dt_bias.data.view(2, 32), -5.0, torch.bfloat16)
    assert torch.equal(ours, want.float())
    assert not torch.equal(kda_gate(logits, hf_gate.A_log.data, hf_gate.dt_bias.data.view(2, 32), -5.0), want.float())
    kw = dict(max_model_len=64, warmup=False, **{**REF, "dtype": "bfloat16"})
    ling = LLM("ling-tiny", **kw).engine.runner.model.kda_layers[0]
    kimi = LLM("kimi-tiny", **kw).engine.runner.model.kda_layers[0]
    assert ling.kda_weights.gate_dtype == torch.bfloat16 and kimi.kda_weights.gate_dtype is None


def test_triton_paths_in_the_interpreter_give_the_reference_tokens():
    """flash prefill (chunked), fused decode, the MLA kernels with the rotated cache and the fused MoE
    (grouped routing on its torch path), through the engine, on the built-in ling-tiny."""
    # One prompt in two prefill chunks, then decode steps: every Triton path runs, at the least cost.
    prompts, greedy = ["The quick brown fox jumps"], SamplingParams(max_tokens=3, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_model_len=64, warmup=False)
    want = [o.output_token_ids for o in LLM("ling-tiny", **REF, **kw).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM("ling-tiny", kda_prefill_backend="flash", kda_decode_backend="fused", mla_backend="triton",
              moe_backend="triton", dtype="float32", max_num_batched_tokens=16, **kw)
    assert [o.output_token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want


# ---- configs and checkpoints ----------------------------------------------------------------------

def test_config_in_the_released_spelling_and_in_transformers_own():
    released = {"model_type": "bailing_hybrid", "hidden_size": 64, "num_hidden_layers": 7, "vocab_size": 300,
                "head_dim": 32, "qk_rope_head_dim": 16, "num_experts": 16, "num_experts_per_token": 4,
                "num_shared_experts": 2, "num_expert_group": 4, "topk_group": 2, "moe_renormalize": False,
                "model_max_length": 8192, "num_nextn_predict_layers": 0, "short_conv_kernel_size": 3,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "layer_group_size": 3,
                "first_k_dense_replace": 2, "some_future_key": 1}
    c = BailingHybridConfig.from_dict(released)
    assert c.layer_types == ["linear_attention", "linear_attention", "full_attention"] * 2 + ["linear_attention"]
    assert c.mlp_layer_types == ["dense"] * 2 + ["sparse"] * 5
    assert (c.linear_head_dim, c.qk_rope_head_dim, c.linear_num_heads, c.linear_conv_kernel_dim) == (32, 16, 32, 3)
    assert (c.num_local_experts, c.num_experts_per_tok, c.n_shared_experts, c.n_group) == (16, 4, 2, 4)
    assert not c.norm_topk_prob and c.max_position_embeddings == 8192 and c.num_mtp_layers == 0
    assert c.rope_theta == 1e6 and c.extra == {"some_future_key": 1} and c.linear_lower_bound == -5.0
    assert BailingHybridConfig.from_dict(c.to_dict()) == c
    # transformers' own save writes the rotary size as head_dim and the KDA size as linear_head_dim.
    hf = transformers.BailingHybridConfig(**{k: v for k, v in released.items() if k != "model_type"}).to_dict()
    assert hf["head_dim"] == 16 and hf["linear_head_dim"] == 32
    again = BailingHybridConfig.from_dict(hf)
    assert (again.linear_head_dim, again.qk_rope_head_dim, again.layer_types) == (32, 16, c.layer_types)
    assert BailingHybridConfig.from_dict({**released, "kda_safe_gate": False}).linear_lower_bound is None


@pytest.mark.parametrize("bad, match", [
    ({"layer_types": ["linear_attention", "mamba"]}, r"layer_types holds \['mamba'\]"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4}}, "default rotary embedding only"),
    ({"num_key_value_heads": 2}, "must equal num_attention_heads"),
    ({"kda_lower_bound": -6.0}, r"\[-5, 0\)"),
    ({"hidden_act": "gelu"}, "only silu"),
    ({"num_experts": 10, "num_expert_group": 4}, "equal groups"),
    ({"qk_rope_head_dim": 0}, "even and positive"),
    ({"attention_bias": True}, "attention has no biases"),
    ({"layer_group_size": 0}, "layer_group_size must be >= 1"),
])
def test_bad_configs_are_refused_with_the_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        BailingHybridConfig.from_dict({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 300, "num_experts": 16,
                                       "n_group": 4, "topk_group": 2, **bad})


def test_a_rotary_table_of_another_size_is_refused():
    from kdaserve.layers.mla import MLAttention
    from kdaserve.layers.rotary import RotaryEmbedding

    with pytest.raises(ValueError, match=r"rotates heads of 32, but q_pe / k_pe have qk_rope_head_dim = 16"):
        MLAttention(64, 2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                    rotary=RotaryEmbedding(32, 32, 64, 1e4, interleaved=True), backend="reference")


def test_bad_checkpoints_name_the_tensor(tmp_path):
    config = tiny_config()
    kw = dict(max_model_len=64, **REF)
    write_checkpoint(tmp_path / "missing", config, mutate=lambda t: t.pop("model.layers.0.attention.f_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.0\.attention\.f_proj\.weight"):
        LLM(str(tmp_path / "missing"), **kw)
    write_checkpoint(tmp_path / "shape", config, mutate=lambda t: t.__setitem__(
        "model.layers.2.attention.g_proj.weight", torch.zeros(3, 64)))
    with pytest.raises(ValueError, match=r"attention\.g_proj\.weight has shape \[3, 64\]; expected \[4, 64\]"):
        LLM(str(tmp_path / "shape"), **kw)
    write_checkpoint(tmp_path / "renamed", config, mutate=lambda t: t.__setitem__(   # transformers' name
        "model.layers.0.self_attn.forget_gate.f_proj.weight", t.pop("model.layers.0.attention.f_proj.weight")))
    with pytest.raises(ValueError, match=r"does not have.*self_attn\.forget_gate\.f_proj"):
        LLM(str(tmp_path / "renamed"), **kw)


def test_q_lora_sizes_load_under_their_released_names(tmp_path):
    """Some Ling-3 sizes project q through a low-rank pair (q_a_proj, q_a_layernorm, q_b_proj), as
    DeepSeek's MLA does; transformers' port has none, so this checks loading and a deterministic run."""
    config = tiny_config(q_lora_rank=24)
    shapes = released_shapes(config)
    assert shapes["model.layers.2.attention.q_a_proj.weight"] == (24, 64)
    assert "model.layers.2.attention.q_proj.weight" not in shapes
    ckpt = write_checkpoint(tmp_path / "qlora", config)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    a, b = (LLM(str(ckpt), max_model_len=128, **REF).generate(PROMPTS[:2], greedy, use_tqdm=False) for _ in range(2))
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]


def test_released_shape_and_a_model_too_large_says_what_fits():
    """Ling-3.0-Flash as transformers describes it: 42 layers (35 KDA, 7 MLA, every 6th), 2 dense,
    512 experts top-8 in 8 groups; 124.4B parameters, 232 GiB in bf16: two H200s, or one with FP8 experts
    and linears (121.3B of them in FP8, 119 GiB)."""
    from kdaserve.models.bailing_hybrid import keeps_fp8
    from kdaserve.models.builtin import released_config
    from kdaserve.models.capacity import parameter_count, weights_fit_error

    c = released_config("inclusionAI/Ling-3.0-Flash")
    assert c.attention_layer_ids == [5, 11, 17, 23, 29, 35, 41] and len(c.kda_layer_ids) == 35
    assert c.mlp_layer_types[:3] == ["dense", "dense", "sparse"] and c.router.grouped
    shapes = released_shapes(c)
    n = parameter_count(shapes)
    experts = 40 * 512 * 3 * 768 * 2560
    assert experts < n < experts + 5e9, n
    message = weights_fit_error("inclusionAI/Ling-3.0-Flash", n, torch.bfloat16, 141 * 2**30)
    assert "GiB of weights in bfloat16" in message and "--tensor-parallel-size" in message
    fp8 = parameter_count({name: s for name, s in shapes.items() if keeps_fp8(c, name, True)})
    assert weights_fit_error("inclusionAI/Ling-3.0-Flash", n, torch.bfloat16, 141 * 2**30, fp8) is None
    assert 2.4e9 < parameter_count(released_shapes(c, mtp=True)) - n < 3.4e9   # the MTP layer: 512 experts + MLA


# ---- the MTP drafter (speculative method "mtp") ------------------------------------------------

MTP = dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1})
MTP3 = dict(speculative_config={"method": "mtp", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ling_mtp") / "ckpt", tiny_config(num_mtp_layers=1), seed=7)


def test_mtp_speculation_is_lossless(mtp_checkpoint):
    """Greedy tokens with MTP drafts equal those without: batched with chunked prefill (one draft),
    and with a preemption (the tight pool, three drafts)."""
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.output_token_ids for o in LLM(str(mtp_checkpoint), max_model_len=256, **REF).generate(
        PROMPTS, greedy, use_tqdm=False)]
    for kw, spec in ((dict(max_num_batched_tokens=8), MTP), (dict(max_model_len=112, num_kv_blocks=10, block_size=16), MTP3)):
        llm = LLM(str(mtp_checkpoint), **{"max_model_len": 256, **kw}, **REF, **spec)
        assert [o.output_token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == want, kw
        assert llm.engine.stats()["spec_decode_num_drafts"] > 0, "the drafter proposed nothing"


def test_mtp_drafts_equal_a_pass_from_scratch(mtp_checkpoint):
    """Every draft made during generation (the MTP layer's rotated latent cache filled step by step:
    a chunked prompt, then verify steps that accept or reject, two more passes per step with 3
    drafts) equals the drafts a fresh engine makes from one prefill of the same tokens."""
    kw = dict(max_model_len=256, max_num_batched_tokens=8, **REF, **MTP3)
    made, tokens = drafts_after_each_step(LLM(str(mtp_checkpoint), **kw), PROMPTS[1], 12)
    assert len(made) >= 4 and len(tokens) == len(PROMPTS[1]) + 12 and all(len(d) == 3 for _, d in made)
    fresh = LLM(str(mtp_checkpoint), max_model_len=256, **REF, **MTP3)
    for seq_len, drafts in made[::2]:
        again, _ = drafts_after_each_step(fresh, tokens[: seq_len - 1], 2)
        assert again[0] == (seq_len, drafts), (seq_len, again[0], drafts)


def test_the_mtp_layer_combines_embedding_and_hidden_state_as_vllm_does():
    """With its attention and MLP silenced, the layer is final_layernorm(eh_proj([enorm(embed of
    the next token, zero at position 0), hnorm(target hidden)])), as vLLM's Bailing MTP layer."""
    from torch import nn

    from kdaserve.models.bailing_hybrid import make_rotary
    from kdaserve.models.bailing_hybrid_mtp import BailingHybridMTP

    class Silent(nn.Module):
        def forward(self, *args):
            return torch.zeros_like(args[-1])

    torch.manual_seed(0)
    config = tiny_config(num_mtp_layers=1)
    mtp = BailingHybridMTP(config, make_rotary(config, "cpu"), mla_backend="reference", moe_backend="reference",
                           dtype=torch.float32, device="cpu")
    for norm in (mtp.enorm, mtp.hnorm, mtp.final_layernorm):
        norm.weight.copy_(1 + 0.3 * torch.randn(64))
    mtp.eh_proj.weight.copy_(torch.randn(64, 128) / 8)
    mtp.self_attn, mtp.mlp = Silent(), Silent()
    e, h, positions = torch.randn(5, 64), torch.randn(5, 64), torch.tensor([0, 1, 2, 7, 0])

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w

    e_used = torch.where((positions == 0)[:, None], 0.0, e)
    want = rms(torch.cat([rms(e_used, mtp.enorm.weight), rms(h, mtp.hnorm.weight)], -1) @ mtp.eh_proj.weight.T,
               mtp.final_layernorm.weight)
    torch.testing.assert_close(mtp(e, positions, h), want, rtol=1e-5, atol=1e-5)


def test_mtp_needs_the_layer_and_is_skipped_without_the_method(tmp_path, mtp_checkpoint, caplog):
    no_layer = write_checkpoint(tmp_path / "no_mtp", tiny_config())
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 0"):
        LLM(str(no_layer), max_model_len=64, **REF, **MTP)
    lacking = tmp_path / "lacking"
    shutil.copytree(mtp_checkpoint, lacking)
    t = load_file(str(lacking / "model.safetensors"))
    t.pop("model.layers.6.eh_proj.weight")
    save_file(t, str(lacking / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.6\.eh_proj\.weight"):
        LLM(str(lacking), max_model_len=64, **REF, **MTP)
    with caplog.at_level(logging.INFO, logger="kdaserve.models.bailing_hybrid"):
        llm = LLM(str(mtp_checkpoint), max_model_len=64, **REF)
    assert llm.engine.runner.model.mtp is None
    assert "the multi-token-prediction layer): not drafting" in caplog.text
