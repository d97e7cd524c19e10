"""GLM-5.3-Flash against transformers 5.23.0 (`Glm5NextForConditionalGeneration` with a tiny vision
config, fp32 on the CPU): a tiny random checkpoint written with the **released** tensor names in the
released nested config, loaded by both. Every term transformers' initialisation would leave trivial
is randomised (pool ape and compress gate, hc base and scale, A_log, the correction bias).

Two configs: a **sparse** one (index_topk 8 in pools of 4, prompts up to 37 tokens, so queries see
more than topk + kpool - 1 = 11 tokens and the selection matters: a test shows the logits differ
from dense attention) with a shared-indexer layer, and a **dense** one (index_topk covers every
prompt). Log-probs of every position within relative RMS 1e-4 and 32 greedy tokens identical,
alone, batched, with chunked prefill and with a preemption."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from family_parity import check_greedy_alone_batched_chunked_preempted, drafts_after_each_step, hf_greedy, logprob_rows
from safetensors.torch import save_file

from kdaserve.engine import LLM, SamplingParams
from kdaserve.models.glm5_next import random_released_tensors, released_shapes
from kdaserve.models.glm5_next_config import Glm5NextConfig
from kdaserve.testing.compare import assert_rel_close, rel_rms

VOCAB = 260
# fp32 wherever the engine runs (on a GPU it would default to bf16), as transformers runs on the CPU.
REF = dict(kda_prefill_backend="reference", kda_decode_backend="reference", mla_backend="reference",
           moe_backend="reference", dtype="float32")
PROMPTS = [[72, 101, 108, 108, 111, 32, 75, 68, 65], list(range(40, 77)), [7], [200 + (i * 7) % 50 for i in range(23)]]
TINY_VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
               "projection_intermediate_size": 64, "patch_size": 14, "image_size": 28}


def tiny_config(**overrides) -> Glm5NextConfig:
    """KDA, DSA (full indexer), DSA (shared: reuses layer 1's selection), KDA, DSA (full); dense first layer."""
    kw = dict(hidden_size=64, num_hidden_layers=5, vocab_size=VOCAB,
              layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                           "indexed_attention"],
              mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
              indexer_types=["full", "full", "shared", "full", "full"],
              linear_num_heads=2, linear_head_dim=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
              kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=8,
              index_kpool=4, hc_mult=4, hc_sinkhorn_iters=20, intermediate_size=96, moe_intermediate_size=32,
              n_routed_experts=8, num_experts_per_tok=3, routed_scaling_factor=2.5, swiglu_limit=1.5,
              max_position_embeddings=4096, eos_token_id=256, pad_token_id=None, torch_dtype="float32")
    kw.update(overrides)
    return Glm5NextConfig(**kw)


def write_checkpoint(path, config: Glm5NextConfig, seed: int = 3, mutate=None, extra_tensors=None):
    """The released layout: config.json nested under text_config beside a vision config, one shard."""
    path.mkdir(parents=True, exist_ok=True)
    text = {**config.to_dict(), "model_type": "glm5_next_text"}
    released = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"], "text_config": text,
                "vision_config": TINY_VISION, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(released))
    tensors = {k: v.contiguous() for k, v in random_released_tensors(config, seed, dtype=torch.float32)}
    tensors.update(extra_tensors or {})
    if mutate is not None:
        mutate(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module", params=["sparse", "dense"])
def case(request, tmp_path_factory):
    config = tiny_config() if request.param == "sparse" else tiny_config(index_topk=64)
    ckpt = write_checkpoint(tmp_path_factory.mktemp("glm") / "ckpt", config)
    hf = transformers.Glm5NextForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    return request.param, ckpt, hf


def _logprobs(llm, prompts):
    return logprob_rows(llm, prompts, VOCAB)


def test_log_probs_of_every_position_match_transformers(case):
    _, ckpt, hf = case
    llm = LLM(str(ckpt), max_model_len=256, max_logprobs=VOCAB, **REF)
    for prompt, ours in zip(PROMPTS, _logprobs(llm, PROMPTS)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert not ours.isnan().any()
        assert rel_rms(ours, ref) <= 1e-4, (len(prompt), rel_rms(ours, ref))


def test_the_sparse_selection_changes_the_result(case, tmp_path):
    """Guards the test above: in the sparse config the long prompt's later positions differ from
    dense attention (same weights, topk widened), so the selection is really exercised."""
    kind, ckpt, _ = case
    if kind != "sparse":
        pytest.skip("the dense config has nothing to select")
    dense_dir = tmp_path / "dense"
    shutil.copytree(ckpt, dense_dir)
    d = json.loads((dense_dir / "config.json").read_text())
    d["text_config"]["index_topk"] = 64
    (dense_dir / "config.json").write_text(json.dumps(d))
    long = [PROMPTS[1]]
    sparse_lp = _logprobs(LLM(str(ckpt), max_model_len=256, max_logprobs=VOCAB, **REF), long)[0]
    dense_lp = _logprobs(LLM(str(dense_dir), max_model_len=256, max_logprobs=VOCAB, **REF), long)[0]
    assert torch.equal(sparse_lp[:11], dense_lp[:11]), "up to topk + kpool - 1 tokens the selection is dense"
    assert rel_rms(sparse_lp[11:], dense_lp[11:]) > 1e-3


def test_32_greedy_tokens_match_transformers_alone_batched_chunked_and_preempted(case):
    _, ckpt, hf = case
    check_greedy_alone_batched_chunked_preempted(str(ckpt), PROMPTS, [hf_greedy(hf, p) for p in PROMPTS], REF)


# ---- configs and checkpoints ----------------------------------------------------------------------

def test_config_forms_flat_nested_and_linear_attn_config():
    nested = {"model_type": "glm5_next", "text_config": {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 300,
                                                         "mhc": True, "mla_use_nope": True, "topk_method": "noaux_tc",
                                                         "scoring_func": "sigmoid", "moe_router_dtype": "float32",
                                                         "num_nextn_predict_layers": 1, "num_local_experts": 16,
                                                         "linear_attn_config": {"num_heads": 8, "head_dim": 64,
                                                                                "short_conv_kernel_size": 4,
                                                                                "gate_lower_bound": -4.0,
                                                                                "kda_layers": [0, 1, 3],
                                                                                "full_attn_layers": [2]}},
              "eos_token_id": [5, 6], "quantization_config": {"weight_block_size": [128, 128]}}
    c = Glm5NextConfig.from_dict(nested)
    assert c.layer_types == ["linear_attention", "linear_attention", "indexed_attention", "linear_attention"]
    assert (c.linear_num_heads, c.linear_head_dim, c.linear_lower_bound) == (8, 64, -4.0)
    assert c.n_routed_experts == 16 and c.eos_token_id == [5, 6] and c.num_mtp_layers == 1
    assert c.mlp_layer_types == ["dense", "dense", "dense", "sparse"] and c.extra["mhc"] is True
    flat = Glm5NextConfig.from_dict({"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 300,
                                     "layer_types": ["linear_attention"] * 3 + ["deepseek_sparse_attention"]
                                     + ["linear_attention"] * 3 + ["full_attention"]})
    assert flat.attention_layer_ids == [3, 7]
    default = Glm5NextConfig()   # as released: 34 KDA + 11 attention layers, 45 in all
    assert len(default.kda_layer_ids) == 34 and default.attention_layer_ids == list(range(3, 45, 4))


@pytest.mark.parametrize("bad, match", [
    ({"layer_types": ["linear_attention", "mamba", "indexed_attention", "linear_attention"]}, "unknown layer types"),
    ({"indexer_types": ["full", "full", "full", "shared"]}, "layer 2 is not an attention layer with a full indexer"),
    ({"qk_rope_head_dim": 64}, "no rotary"),
    ({"linear_attn_config": {"kda_layers": [0, 1, 4], "full_attn_layers": [2]}}, "0-based"),
    ({"index_topk": 100, "index_kpool": 16}, "multiple of index_kpool"),
    ({"linear_attn_config": {"gate_lower_bound": None}, "linear_lower_bound": None}, "bounded gate"),
    ({"hidden_act": "gelu"}, "only silu"),
])
def test_bad_configs_are_refused_with_the_reason(bad, match):
    base = {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 300}
    with pytest.raises(ValueError, match=match):
        Glm5NextConfig.from_dict({**base, **bad})


def _load(path):
    from kdaserve.models.loader import load_model

    return load_model(str(path), dtype=torch.float32, device="cpu", mla_backend="reference", moe_backend="reference")


def test_bad_checkpoints_name_the_tensor(tmp_path):
    config = tiny_config()
    name = "model.language_model.layers.1.self_attn.indexer.wk.weight"
    write_checkpoint(tmp_path / "missing", config, mutate=lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*indexer\.wk\.weight"):
        _load(tmp_path / "missing")
    hc = "model.language_model.layers.1.hc_attn_fn"
    write_checkpoint(tmp_path / "shape", config, mutate=lambda t: t.__setitem__(hc, t[hc][:, :-1].contiguous()))
    with pytest.raises(ValueError, match=r"hc_attn_fn has shape \[24, 255\]; expected \[24, 256\]"):
        _load(tmp_path / "shape")
    shared = "model.language_model.layers.2.self_attn.indexer.wk.weight"   # layer 2 shares: it has no indexer
    write_checkpoint(tmp_path / "unknown", config, extra_tensors={shared: torch.zeros(16, 64)})
    with pytest.raises(ValueError, match=r"does not have.*layers\.2\.self_attn\.indexer\.wk"):
        _load(tmp_path / "unknown")


def test_vision_tower_and_mtp_layer_are_skipped_with_one_line(tmp_path, caplog):
    """Text only (the tower not built): its tensors and the MTP layer's skipped, one line each. A
    model built with its tower refuses a partial one, naming what is missing; a checkpoint without
    any tower tensor serves text only."""
    from kdaserve.models.loader import load_model

    config = tiny_config()
    extra = {"model.visual.blocks.0.attn.qkv.weight": torch.zeros(96, 32), "model.visual.merger.proj.weight": torch.zeros(4, 4),
             "model.language_model.layers.5.eh_proj.weight": torch.zeros(64, 128)}
    write_checkpoint(tmp_path / "ckpt", config, extra_tensors=extra)
    with caplog.at_level(logging.INFO, logger="kdaserve.models.glm5_next"):
        load_model(str(tmp_path / "ckpt"), dtype=torch.float32, device="cpu", mla_backend="reference",
                   moe_backend="reference", images=False)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert sum("vision tower" in m for m in lines) == 1 and sum("multi-token-prediction" in m for m in lines) == 1
    with pytest.raises(ValueError, match=r"vision tower does not match its vision_config: \d+ tensors missing \(e\.g\. "
                                         r"\['model\.visual\."):
        _load(tmp_path / "ckpt")
    write_checkpoint(tmp_path / "text", config)
    assert _load(tmp_path / "text").model.visual is None


def test_released_shapes_cover_the_released_architecture():
    shapes = released_shapes(Glm5NextConfig(num_hidden_layers=4))
    p = "model.language_model.layers."
    assert shapes[p + "0.self_attn.A_log"] == (64,) and shapes[p + "0.self_attn.q_conv1d.weight"] == (8192, 1, 4)
    assert shapes[p + "3.self_attn.kv_a_proj_with_mqa.weight"] == (512, 4096)          # no rope rows
    assert shapes[p + "3.self_attn.q_b_proj.weight"] == (64 * 256, 1536)
    assert shapes[p + "3.self_attn.indexer.index_kpool_compress_ape"] == (16, 128)
    assert shapes[p + "0.hc_attn_fn"] == (24, 4 * 4096) and shapes[p + "0.mlp.gate_proj.weight"] == (12288, 4096)
    assert shapes[p + "3.mlp.experts.287.down_proj.weight"] == (4096, 2048)


# ---- FP8 block-scaled checkpoints, capacity, the built-in ------------------------------------------

def _quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's format: per block the max |w| maps to FP8's max (448); returns (fp8, scale_inv)."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(br, block, bc, block)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale_inv[:, None, :, None]).view(br * block, bc * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale_inv


def _fp8_checkpoints(tmp_path):
    """(config, path of a tiny FP8 checkpoint, path of the same weights dequantized, the dequantized tensors)."""
    from kdaserve.models.fp8 import dequantize_block_fp8

    config = tiny_config()
    # 32-wide blocks: FP8 tensor-core dots take K steps of at least 32.
    config.extra["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}
    quantized, dequantized = {}, {}

    def fp8(tensors):
        for name in list(tensors):
            t = tensors[name]
            # Linear weights are quantized, as released; norms, embeddings, the head and the router are not.
            if (t.dim() == 2 and name.endswith("proj.weight") and "norm" not in name) or name.endswith(".wk.weight"):
                q, s = _quantize_fp8(t, 32)
                quantized[name], quantized[name + "_scale_inv"] = q, s
                dequantized[name] = dequantize_block_fp8(q, s, (32, 32), torch.float32, name)
        tensors.update(quantized)

    write_checkpoint(tmp_path / "fp8", config, mutate=fp8)
    write_checkpoint(tmp_path / "ref", config, mutate=lambda t: t.update(dequantized))
    return config, tmp_path / "fp8", tmp_path / "ref", dequantized, fp8


def test_fp8_block_scaled_checkpoint_loads_as_its_dequantized_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("KDASERVE_FP8_WEIGHTS", "dequantize")    # what every device without FP8 dots does
    config, fp8_path, ref_path, dequantized, fp8 = _fp8_checkpoints(tmp_path)
    assert len(dequantized) > 40 and any(name.endswith("experts.0.down_proj.weight") for name in dequantized)
    a = _logprobs(LLM(str(fp8_path), max_model_len=256, max_logprobs=VOCAB, **REF), PROMPTS[:2])
    b = _logprobs(LLM(str(ref_path), max_model_len=256, max_logprobs=VOCAB, **REF), PROMPTS[:2])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    name = next(iter(dequantized))
    write_checkpoint(tmp_path / "orphan", config, mutate=lambda t: (fp8(t), t.pop(name + "_scale_inv")))
    with pytest.raises(ValueError, match=r"FP8 weights without their _scale_inv"):
        _load(tmp_path / "orphan")


def test_fp8_kept_weights_run_block_scaled_gemms(tmp_path, monkeypatch):
    """Kept FP8 (as on a GPU with FP8 dots): the MLPs, experts and attention projections stay FP8
    with their scales and run the block-scaled GEMMs (the interpreter here), close to the model
    built from the dequantized weights (FP8 activations are the difference)."""
    import triton

    from kdaserve.ops.fp8.reference import FP8

    if not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("KDASERVE_FP8_WEIGHTS", "keep")
    _, fp8_path, ref_path, _, _ = _fp8_checkpoints(tmp_path)
    kept = {}
    for moe in ("triton", "reference"):
        llm = LLM(str(fp8_path), max_model_len=256, max_logprobs=VOCAB, warmup=False, **{**REF, "moe_backend": moe})
        kept[moe] = _logprobs(llm, PROMPTS[:2])
    layers = llm.engine.runner.model.model.layers
    assert layers[1].mlp.w13.dtype == FP8 and layers[1].mlp.shared_experts.down_proj.weight.dtype == FP8
    assert layers[0].mlp.gate_up_proj.weight.dtype == FP8 and layers[1].self_attn.o_proj.weight.dtype == FP8
    assert layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32        # read as absorbed views
    assert layers[0].self_attn.o_proj.weight.dtype == torch.float32           # a KDA layer's projections
    monkeypatch.setenv("KDASERVE_FP8_WEIGHTS", "dequantize")
    ref = _logprobs(LLM(str(ref_path), max_model_len=256, max_logprobs=VOCAB, **REF), PROMPTS[:2])
    for t, r, d in zip(kept["triton"], kept["reference"], ref):
        # Summation order moves an activation across an FP8 rounding boundary now and then (one
        # code is 6%): the fused kernels and the torch definition agree to 1e-3, not to fp32.
        assert_rel_close(t, r, 5e-3, "FP8 experts: fused kernels vs the torch definition")
        # The bound sits between what FP8 activations move the log-probs by here (2.1-2.5%) and what
        # the experts' gate and up scales swapped at load move them by (5%).
        assert rel_rms(t, d) < 0.035, "kept FP8 vs the dequantized model (log-probs)"


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_at_load(tmp_path, monkeypatch):
    """vLLM's --quantization fp8: the experts and linear projections of a checkpoint in full
    precision are quantized at load (the config's blocks here, 128 x 128 by default) and run as
    the same checkpoint released in FP8 does; families without an FP8 path and sizes FP8 cannot
    take are refused at startup, saying why."""
    import triton

    from kdaserve.ops.fp8.reference import FP8

    if not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    _, fp8_path, ref_path, _, _ = _fp8_checkpoints(tmp_path)
    monkeypatch.setenv("KDASERVE_FP8_WEIGHTS", "keep")
    released = _logprobs(LLM(str(fp8_path), max_model_len=256, max_logprobs=VOCAB, warmup=False, **REF), PROMPTS[:2])
    monkeypatch.delenv("KDASERVE_FP8_WEIGHTS")
    llm = LLM(str(ref_path), max_model_len=256, max_logprobs=VOCAB, warmup=False, quantization="fp8", **REF)
    layers = llm.engine.runner.model.model.layers
    assert layers[1].mlp.w13.dtype == FP8 and layers[1].self_attn.q_b_proj.weight.dtype == FP8
    for a, b in zip(_logprobs(llm, PROMPTS[:2]), released):
        assert_rel_close(a, b, 1e-4, "quantized at load vs released in FP8")
    with pytest.raises(ValueError, match=r"kda_hybrid \(tiny\) has no FP8 path yet"):
        LLM("tiny", max_model_len=64, quantization="fp8", **REF)
    with pytest.raises(ValueError, match=r"--quantization fp8 cannot run this model: the MLP widths \(128, 32\) must be "
                                         r"multiples of the 128-row block"):
        LLM("glm-tiny", max_model_len=64, quantization="fp8", **REF)
    with pytest.raises(ValueError, match="invalid quantization: got 'int4'"):
        LLM("glm-tiny", max_model_len=64, quantization="int4", **REF)


def test_fp8_scales_of_the_wrong_shape_or_without_a_weight_are_named():
    from kdaserve.models.fp8 import dequantized_weights

    w = torch.ones(40, 20).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"x\.weight_scale_inv has shape \[2, 2\]; a \[40, 20\] weight in 16 x 16 "
                                         r"blocks needs \[3, 2\]"):
        list(dequantized_weights([("x.weight", w), ("x.weight_scale_inv", torch.ones(2, 2))], torch.float32, (16, 16)))
    with pytest.raises(ValueError, match=r"_scale_inv tensors without an FP8 weight: \['y\.weight_scale_inv'\]"):
        list(dequantized_weights([("y.weight_scale_inv", torch.ones(1, 1))], torch.float32))
    # A kept weight that arrives unquantized (dummy weights, a bf16 checkpoint) is quantized at load.
    w = torch.randn(40, 20)
    out = dict(dequantized_weights([("z.weight", w)], torch.float32, (16, 16), keep=lambda n: n == "z.weight"))
    assert out["z.weight"].dtype == torch.float8_e4m3fn and out["z.weight_scale_inv"].shape == (3, 2)


def test_a_model_too_large_for_the_gpu_says_so_with_the_numbers():
    from kdaserve.models.builtin import released_config
    from kdaserve.models.capacity import parameter_count, weights_fit_error

    config = released_config("zai-org/GLM-5.3-Flash")
    n = parameter_count(released_shapes(config))
    assert 300e9 < n < 330e9    # ~320B as released (the vision tower and MTP layer not counted)
    # With the MTP drafter its layer counts too (288 experts of 3 x 2048 x 4096: ~7.2B).
    assert 7e9 < parameter_count(released_shapes(config, mtp=True)) - n < 8e9
    message = weights_fit_error("zai-org/GLM-5.3-Flash", n, torch.bfloat16, 141 * 2**30)
    assert "313.3B parameters" in message and "584 GiB" in message and "141 GiB" in message and "vLLM" in message
    assert weights_fit_error("small", 10**9, torch.bfloat16, 141 * 2**30) is None
    # With its experts and linears in FP8 (--quantization fp8) the weights take one byte each.
    from kdaserve.models.glm5_next import keeps_fp8

    shapes = released_shapes(config)
    fp8 = parameter_count({name: s for name, s in shapes.items() if keeps_fp8(config, name, True)})
    assert 300e9 < fp8 < n
    message = weights_fit_error("zai-org/GLM-5.3-Flash", n, torch.bfloat16, 141 * 2**30, fp8)
    assert "(307.0B of them in FP8): 298 GiB of weights in bfloat16 and FP8" in message
    assert weights_fit_error("half", 2 * 10**9, torch.bfloat16, 3 * 2**30, 2 * 10**9) is None   # fits only in FP8


def test_the_glm_tiny_builtin_generates():
    out = LLM("glm-tiny", max_model_len=128).generate(["KDA is"], SamplingParams(max_tokens=8, ignore_eos=True),
                                                      use_tqdm=False)
    assert len(out[0].output_token_ids) == 8


def test_the_triton_hyper_connections_and_index_scores_match_transformers(case):
    """--mla-backend triton runs mHC through its two Triton kernels, the DSA index scores through theirs
    and decode attention through the sparse MLA kernel (the interpreter on a CPU)."""
    import triton

    if not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    kind, ckpt, hf = case
    if kind != "sparse":
        pytest.skip("one config is enough for the kernels (interpreter time)")
    llm = LLM(str(ckpt), max_model_len=256, max_logprobs=VOCAB, warmup=False, **{**REF, "mla_backend": "triton"})
    layers = llm.engine.runner.model.model.layers
    assert layers[0].attn_hc.backend == "triton" and layers[1].self_attn.indexer.backend == "triton"
    # The 37-token prompt: its positions past topk + kpool - 1 = 11 select (interpreter time: one prompt).
    for prompt, ours in zip(PROMPTS[1:2], _logprobs(llm, PROMPTS[1:2])):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert rel_rms(ours, ref) <= 1e-4, (len(prompt), rel_rms(ours, ref))
    # Decode steps past topk + kpool - 1 tokens attend through the sparse MLA decode kernel.
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.output_token_ids == hf_greedy(hf, PROMPTS[1], 4)


def test_the_pool_key_cache_equals_recomputing_the_pools(case):
    """Blocks that hold whole pools keep the completed pools' keys (the DSA layer's third cache
    tensor); other block sizes recompute them from the indexer rows every step. Same choices, same
    log-probs and tokens, with chunked prefill so pools complete across chunks and decode steps."""
    kind, ckpt, _ = case
    if kind != "sparse":
        pytest.skip("the dense config chooses everything")
    kept = LLM(str(ckpt), max_model_len=256, max_logprobs=VOCAB, max_num_batched_tokens=8, block_size=16, **REF)
    recomputed = LLM(str(ckpt), max_model_len=256, max_logprobs=VOCAB, max_num_batched_tokens=8, block_size=6, **REF)
    attn = lambda llm: llm.engine.runner.model.model.layers[1].self_attn   # noqa: E731
    assert attn(kept).pool_cache is not None and attn(recomputed).pool_cache is None
    a, b = _logprobs(kept, PROMPTS), _logprobs(recomputed, PROMPTS)
    assert all(torch.allclose(x, y, rtol=0, atol=1e-6) for x, y in zip(a, b))
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    assert ([o.output_token_ids for o in kept.generate(PROMPTS, greedy, use_tqdm=False)]
            == [o.output_token_ids for o in recomputed.generate(PROMPTS, greedy, use_tqdm=False)])


# ---- the MTP drafter (speculative method "mtp") ------------------------------------------------

MTP = dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1})
MTP3 = dict(speculative_config={"method": "mtp", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """The sparse config with its multi-token-prediction layer (index 5) in the checkpoint."""
    config = tiny_config(extra={"num_nextn_predict_layers": 1})
    return write_checkpoint(tmp_path_factory.mktemp("glm_mtp") / "ckpt", config, seed=7)


@pytest.mark.parametrize("spec", [MTP, MTP3], ids=["one-draft", "three-drafts"])
def test_mtp_drafts_equal_a_pass_from_scratch(mtp_checkpoint, spec):
    """Every draft the MTP layer makes during generation (its caches filled step by step: a
    chunked prompt, then verify steps that accept or reject; with 3 drafts, two more passes per
    step over rows past the newest token) equals the drafts a fresh engine makes from one prefill
    of the same tokens: the layer's incremental caches hold what a full pass would. The 37-token
    prompt passes topk + kpool - 1 = 11, so the sparse selection is in play."""
    kw = dict(max_model_len=256, max_num_batched_tokens=8, **REF, **spec)
    made, tokens = drafts_after_each_step(LLM(str(mtp_checkpoint), **kw), PROMPTS[1], 12)
    k = spec["speculative_config"]["num_speculative_tokens"]
    assert len(made) >= 4 and len(tokens) == len(PROMPTS[1]) + 12 and all(len(d) == k for _, d in made)
    fresh = LLM(str(mtp_checkpoint), max_model_len=256, **REF, **spec)
    for seq_len, drafts in made[::2]:
        again, _ = drafts_after_each_step(fresh, tokens[: seq_len - 1], 2)
        assert again[0] == (seq_len, drafts), (seq_len, again[0], drafts)


def test_mtp_speculation_is_lossless(mtp_checkpoint):
    """Greedy tokens with MTP drafts equal those without: alone, batched, with chunked prefill and
    with a preemption (the tight pool)."""
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.output_token_ids for o in LLM(str(mtp_checkpoint), max_model_len=256, **REF).generate(
        PROMPTS, greedy, use_tqdm=False)]
    for kw, spec in ((dict(), MTP), (dict(max_num_batched_tokens=8), MTP), (dict(), MTP3),
                     (dict(max_model_len=80, num_kv_blocks=9, block_size=16), MTP3)):
        llm = LLM(str(mtp_checkpoint), **{"max_model_len": 256, **kw}, **REF, **spec)
        assert [o.output_token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == want, kw
        stats = llm.engine.stats()
        assert stats["spec_decode_num_drafts"] > 0, "the drafter proposed nothing"
    alone = LLM(str(mtp_checkpoint), max_model_len=256, **REF, **MTP)
    assert alone.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].output_token_ids == want[1]


@pytest.mark.gpu
def test_gpu_mtp_with_cuda_graphs_is_lossless(mtp_checkpoint):
    """The verify steps replay CUDA graphs and the MTP passes run after them under the replayed
    step's metadata: the same greedy tokens as eager MTP and as no speculation (Triton kernels,
    fp32, batched, 1 and 3 drafts)."""
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    gpu = dict(max_model_len=256, dtype="float32")
    want = [o.output_token_ids for o in LLM(str(mtp_checkpoint), enforce_eager=True, **gpu).generate(
        PROMPTS, greedy, use_tqdm=False)]
    for spec in (MTP, MTP3):
        eager = LLM(str(mtp_checkpoint), enforce_eager=True, **gpu, **spec)
        graphs = LLM(str(mtp_checkpoint), **gpu, **spec)
        assert graphs.engine.runner.graphs is not None, "CUDA graphs are off"
        got_eager = [o.output_token_ids for o in eager.generate(PROMPTS, greedy, use_tqdm=False)]
        got = [o.output_token_ids for o in graphs.generate(PROMPTS, greedy, use_tqdm=False)]
        assert got == got_eager == want, spec
        assert graphs.engine.stats()["spec_decode_num_drafts"] > 0, "the drafter proposed nothing"


def test_mtp_needs_the_layer(tmp_path, mtp_checkpoint):
    from kdaserve.engine.speculative import SpeculativeConfig

    # vLLM's spellings: model-specific names are deprecated aliases; k defaults to the MTP layers (1).
    assert SpeculativeConfig.parse({"method": "glm5_next_mtp"}) == SpeculativeConfig.parse(MTP["speculative_config"])
    assert SpeculativeConfig.parse('{"method": "mtp"}').num_speculative_tokens == 1
    no_layer = write_checkpoint(tmp_path / "no_mtp", tiny_config())
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 0"):
        LLM(str(no_layer), max_model_len=64, **REF, **MTP)
    with pytest.raises(ValueError, match=r"kimi_linear \(kimi-tiny\) has none"):
        LLM("kimi-tiny", max_model_len=64, **REF, **MTP)
    lacking = tmp_path / "lacking"
    shutil.copytree(mtp_checkpoint, lacking)
    from safetensors.torch import load_file

    t = load_file(str(lacking / "model.safetensors"))
    t.pop("model.language_model.layers.5.eh_proj.weight")
    save_file(t, str(lacking / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.5\.eh_proj\.weight"):
        LLM(str(lacking), max_model_len=64, **REF, **MTP)
    # Without the MTP method the layer's tensors are skipped, and the model is the same.
    assert LLM(str(mtp_checkpoint), max_model_len=64, **REF).engine.runner.model.mtp is None


def test_the_mtp_layer_combines_embedding_and_hidden_state_as_vllm_does():
    """With its attention and MLP silenced, the layer is shared_head.norm(eh_proj([enorm(embed of
    the next token, zero at position 0), hnorm(target hidden)])): the order of the concatenation,
    the norms and the position-0 rule, in vLLM's definition of GLM-5.3-Flash's MTP layer."""
    from torch import nn

    from kdaserve.models.glm5_next_mtp import Glm5NextMTP

    class Silent(nn.Module):
        def forward(self, *args):
            return torch.zeros_like(args[-1])

    torch.manual_seed(0)
    config = tiny_config(extra={"num_nextn_predict_layers": 1})
    mtp = Glm5NextMTP(config, mla_backend="reference", moe_backend="reference", dtype=torch.float32, device="cpu")
    for norm in (mtp.enorm, mtp.hnorm, mtp.shared_head.norm):
        norm.weight.copy_(1 + 0.3 * torch.randn(64))
    mtp.eh_proj.weight.copy_(torch.randn(64, 128) / 8)
    mtp.self_attn, mtp.mlp = Silent(), Silent()
    e, h, positions = torch.randn(5, 64), torch.randn(5, 64), torch.tensor([0, 1, 2, 7, 0])

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w

    e_used = torch.where((positions == 0)[:, None], 0.0, e)
    want = rms(torch.cat([rms(e_used, mtp.enorm.weight), rms(h, mtp.hnorm.weight)], -1) @ mtp.eh_proj.weight.T,
               mtp.shared_head.norm.weight)
    torch.testing.assert_close(mtp(e, positions, h), want, rtol=1e-5, atol=1e-5)


def test_mtp_speculation_with_the_triton_kernels(mtp_checkpoint):
    """The drafter's DSA layer through the Triton indexer and sparse MLA kernels (the interpreter
    on a CPU), the target's too: the same greedy tokens as the reference path without MTP."""
    import triton

    if not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    # 23 tokens: past topk + kpool - 1 = 11, so the selection is sparse; short for the interpreter.
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    want = [o.output_token_ids for o in LLM(str(mtp_checkpoint), max_model_len=256, **REF).generate(
        PROMPTS[3:4], greedy, use_tqdm=False)]
    llm = LLM(str(mtp_checkpoint), max_model_len=256, warmup=False, **{**REF, "mla_backend": "triton"}, **MTP)
    assert llm.engine.runner.model.mtp.self_attn.backend == "triton"
    assert [o.output_token_ids for o in llm.generate(PROMPTS[3:4], greedy, use_tqdm=False)] == want


def test_the_mtp_caches_after_a_chunked_prompt_equal_one_prefill(mtp_checkpoint):
    """The drafter's latent and indexer cache rows of every prompt position: a prompt prefilled in
    chunks of 8 (steps that sample nothing still run the layer) against one prefill."""
    def caches_after_prefill(**kw):
        llm = LLM(str(mtp_checkpoint), max_model_len=256, **REF, **MTP, **kw)
        engine = llm.engine
        engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
        seq = engine.requests["r"]
        while seq.num_computed_tokens < len(PROMPTS[1]):
            engine.step()
        attn, bs = engine.runner.model.mtp.self_attn, engine.runner.block_size
        pos = torch.arange(len(PROMPTS[1]))
        rows = torch.tensor(seq.block_table)[pos // bs] * bs + pos % bs
        return [c.view(-1, c.shape[-1])[rows] for c in (attn.cache, attn.index_cache)]

    for chunked, whole in zip(caches_after_prefill(max_num_batched_tokens=8), caches_after_prefill()):
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_mtp_with_a_prefix_cache_hit(mtp_checkpoint):
    """A second request with the same prompt resumes past its cached prefix (KDA checkpoint at 32
    tokens, the KV and the drafter's blocks shared): the same greedy tokens, the hit counted, and
    the drafts after the hit equal those of the first request (the drafter's shared rows are
    those a full pass writes)."""
    kw = dict(max_model_len=256, block_size=16, mamba_block_size=32, enable_prefix_caching=True, **REF, **MTP3)
    llm = LLM(str(mtp_checkpoint), **kw)
    first, tokens = drafts_after_each_step(llm, PROMPTS[1], 6)
    engine = llm.engine
    hits = engine.stats()["prefix_cache_hits"]
    engine.add_request("again", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
    second, again = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            again = out.prompt_token_ids + out.output_token_ids
        second += [(n, list(d)) for n, d in engine.proposer._drafts.values()]
    assert engine.stats()["prefix_cache_hits"] > hits
    assert again == tokens and second[0] == first[0]


def test_weights_per_gpu_at_tensor_parallel_say_which_size_fits():
    """One GPU is told the -tp that would fit; at TP N each GPU holds 1/N of the split weights and
    all of the replicated ones, and a size that still does not fit says so per GPU."""
    from kdaserve.models.builtin import released_config
    from kdaserve.models.capacity import _replicated, parameter_count, weights_fit_error

    shapes = released_shapes(released_config("zai-org/GLM-5.3-Flash"))
    n = parameter_count(shapes)
    whole = parameter_count({k: s for k, s in shapes.items() if _replicated(k)})
    one = weights_fit_error("zai-org/GLM-5.3-Flash", n, torch.bfloat16, 141 * 2**30)
    assert "--tensor-parallel-size (at least 5 by the weights alone" in one
    assert weights_fit_error("GLM", n, torch.bfloat16, 141 * 2**30, tp_size=8, replicated_params=whole) is None
    four = weights_fit_error("GLM", n, torch.bfloat16, 141 * 2**30, tp_size=4, replicated_params=whole)
    assert four.startswith("GLM needs 146 GiB of weights on each of 4 GPUs at --tensor-parallel-size 4 (313.3B "
                           "parameters in bfloat16), but each GPU has 141 GiB: give a larger --tensor-parallel-size")
