"""4-bit checkpoints (models/fp4.py, ops/fp4/reference.py): a tiny Kimi-Linear and a tiny GLM-5.3-Flash
checkpoint written here in AMD Quark's MXFP4 and in compressed-tensors' NVFP4 (quantized from the
full-precision weights by each format's rules) load and give the log-probs of their dequantized
twins bit for bit (fp32, the reference paths); the packing and the scales' edge cases; bad and
partial checkpoints named."""

from __future__ import annotations

import json

import pytest
import torch
from family_parity import logprob_rows
from safetensors.torch import save_file

from kdaserve.engine import LLM, SamplingParams
from kdaserve.models.builtin import builtin_config
from kdaserve.ops.fp4.reference import (
    check_nvfp4_scales,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_codes,
    e2m1_values,
    pack_e2m1,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_e2m1,
)

REF = dict(kda_prefill_backend="reference", kda_decode_backend="reference", mla_backend="reference",
           moe_backend="reference", dtype="float32", max_model_len=128, max_logprobs=264, warmup=False)


def _rows(llm, prompts):
    return logprob_rows(llm, prompts, llm.engine.vocab_size)   # the built-ins' byte vocabularies (glm-tiny's has image tokens)
PROMPTS = [[72, 101, 108, 108, 111, 32, 75, 68, 65], list(range(40, 77))]
MXFP4 = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0", "is_dynamic": False}
MXFP4_INPUT = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0", "is_dynamic": True}
NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}

# Which tensors each case quantizes, and the config that says so in the format's own terms.
CASES = {
    # Kimi-Linear, Quark: a global MXFP4 scheme (with dynamic MXFP4 activations, W4A4 as released)
    # and everything but the routed experts excluded by name patterns.
    "kimi-quark": ("kimi-tiny", lambda name: ".experts." in name, {
        "quant_method": "quark", "global_quant_config": {"weight": MXFP4, "input_tensors": MXFP4_INPUT},
        "layer_quant_config": {}, "layer_type_quant_config": {},
        "exclude": ["lm_head", "re:.*self_attn.*", "re:.*\\.gate$", "re:.*shared_experts.*", "re:.*\\.mlp\\..*"]}),
    # GLM-5.3-Flash, Quark: only the experts and shared experts by layer_quant_config patterns.
    "glm-quark": ("glm-tiny", lambda name: ".experts." in name or ".shared_experts." in name, {
        "quant_method": "quark", "global_quant_config": None, "layer_type_quant_config": {},
        "layer_quant_config": {"*.experts.*": {"weight": MXFP4, "input_tensors": None},
                               "*.shared_experts.*": {"weight": MXFP4, "input_tensors": None}}, "exclude": []}),
    # GLM-5.3-Flash, Quark: the dense and shared-expert MLPs only, the routed experts excluded (no
    # layer's experts stay 4-bit: the kept pieces are the MLPs' alone).
    "glm-mlps-quark": ("glm-tiny", lambda name: ".mlp." in name and ".experts." not in name
                       and not name.endswith("mlp.gate.weight"), {
        "quant_method": "quark", "global_quant_config": None, "layer_type_quant_config": {},
        "layer_quant_config": {"*.mlp.*_proj": {"weight": MXFP4, "input_tensors": None}},
        "exclude": ["re:.*\\.experts\\.\\d+\\..*"]}),
    # Kimi-Linear, compressed-tensors: the routed experts targeted by a regex.
    "kimi-nvfp4": ("kimi-tiny", lambda name: ".experts." in name, {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["re:.*\\.experts\\..*"], "weights": NVFP4_WEIGHTS, "input_activations": None,
                                      "format": "nvfp4-pack-quantized"}}, "ignore": ["lm_head"]}),
    # GLM-5.3-Flash, compressed-tensors: every MLP linear (dense, shared, routed) under "Linear" targets,
    # the attention layers and the router ignored.
    "glm-nvfp4": ("glm-tiny", lambda name: ".mlp." in name and not name.endswith("mlp.gate.weight"), {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": NVFP4_WEIGHTS,
                                      "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                            "group_size": 16, "dynamic": "local"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$"]}),
}


def _quantized(name: str, w: torch.Tensor, method: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The checkpoint's tensors for linear `name` (<m>.weight) and its dequantized value."""
    m = name.removesuffix(".weight")
    if method == "quark":
        packed, scale = quantize_mxfp4(w)
        return {m + ".weight": packed, m + ".weight_scale": scale}, dequantize_mxfp4(packed, scale)
    packed, scale, g = quantize_nvfp4(w)
    return ({m + ".weight_packed": packed, m + ".weight_scale": scale, m + ".weight_global_scale": g,
             m + ".input_global_scale": torch.ones(1)}, dequantize_nvfp4(packed, scale, g))


def write_pair(tmp_path, case: str, mutate=None):
    """(the 4-bit checkpoint, its dequantized twin in fp32)."""
    from kdaserve.models.families import family_of_config

    builtin, quantized, qconfig = CASES[case]
    config = builtin_config(builtin)
    family = family_of_config(config)
    tensors = dict(family.random_weights(config, 5, dtype=torch.float32, device="cpu"))
    four_bit, twin = {}, {}
    for name, t in tensors.items():
        # the vision tower (glm-tiny's) stays in full precision, as released 4-bit checkpoints keep it
        if quantized(name) and name.endswith(".weight") and t.dim() == 2 and not name.startswith("model.visual."):
            stored, value = _quantized(name, t, qconfig["quant_method"])
            four_bit.update(stored)
            twin[name] = value
        else:
            four_bit[name] = twin[name] = t.contiguous()
    assert len(four_bit) > len(twin), "the case quantizes nothing"
    if mutate is not None:
        mutate(four_bit)
    paths = []
    for kind, ts, extra in (("fp4", four_bit, {"quantization_config": qconfig}), ("twin", twin, {})):
        path = tmp_path / f"{case}-{kind}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**config.to_dict(), **extra}))
        save_file(ts, str(path / "model.safetensors"))
        paths.append(path)
    return paths


def _moe_layers(llm) -> list:
    from kdaserve.layers.moe import MoEMLP

    return [m for m in llm.engine.runner.model.modules() if isinstance(m, MoEMLP)]


@pytest.mark.parametrize("policy", ["keep", "dequantize"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_4bit_checkpoint_gives_its_dequantized_twins_log_probs_bit_for_bit(tmp_path, monkeypatch, case, policy):
    """Kept (the experts in 4 bits, dequantized by the reference path as it runs them) and
    dequantized at load (KDASERVE_FP4_WEIGHTS=dequantize) alike."""
    monkeypatch.setenv("KDASERVE_FP4_WEIGHTS", policy)
    fp4, twin = write_pair(tmp_path, case)
    llm = LLM(str(fp4), **REF)
    group = {"keep": 32 if "quark" in case else 16, "dequantize": None}[policy]
    experts = None if case == "glm-mlps-quark" else group
    assert {(m.fp4_group, m.w13.dtype) for m in _moe_layers(llm)} == {(experts, torch.uint8 if experts else torch.float32)}
    # the shared experts' and dense MLPs' linears where the case quantizes them, through layers/linear's 4-bit forms
    four_bit_linears = [n for n, m in llm.engine.runner.model.named_modules() if getattr(m, "fp4_group", None)
                        and not hasattr(m, "router")]
    assert bool(four_bit_linears) == (group is not None and case.startswith("glm"))
    ours = _rows(llm, PROMPTS)
    want = _rows(LLM(str(twin), **REF), PROMPTS)
    for a, b in zip(ours, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["glm-quark", "kimi-nvfp4"])
def test_the_fused_4bit_experts_in_the_interpreter_follow_the_twin(tmp_path, case):
    """The Triton MoE path with the experts decoded in its GEMMs (fp32): the twin's log-probs on the
    same path within 1e-4, and its greedy tokens."""
    fp4, twin = write_pair(tmp_path, case)
    kw = dict(REF, moe_backend="triton")
    ours, want = LLM(str(fp4), **kw), LLM(str(twin), **kw)
    assert {m.fp4_group for m in _moe_layers(ours)} == {32 if "quark" in case else 16}
    prompts = PROMPTS[:1]   # the interpreter is slow: one short prompt covers prefill and decode steps
    for a, b in zip(_rows(ours, prompts), _rows(want, prompts)):
        assert (a - b).abs().max() < 1e-4
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    assert ([o.output_token_ids for o in ours.generate(prompts, greedy, use_tqdm=False)]
            == [o.output_token_ids for o in want.generate(prompts, greedy, use_tqdm=False)])


def test_the_flag_names_the_checkpoints_own_format(tmp_path):
    fp4, twin = write_pair(tmp_path, "kimi-quark")
    kw = dict(REF, max_logprobs=1)
    LLM(str(fp4), quantization="quark", **kw)
    LLM(str(fp4), quantization="mxfp4", **kw)
    with pytest.raises(ValueError, match=r"--quantization compressed-tensors needs a compressed-tensors checkpoint, but "
                                         r".*quant_method 'quark'"):
        LLM(str(fp4), quantization="compressed-tensors", **kw)
    with pytest.raises(ValueError, match="quant_method None"):
        LLM(str(twin), quantization="quark", **kw)


@pytest.mark.parametrize("quantization, group", [("mxfp4", 32), ("compressed-tensors", 16)])
def test_random_weights_take_4bit_experts(quantization, group):
    """--load-format dummy (a built-in here) with a 4-bit format: the experts quantized at load."""
    llm = LLM("glm-tiny", quantization=quantization, **dict(REF, max_logprobs=1))
    layers = _moe_layers(llm)
    assert layers and {m.fp4_group for m in layers} == {group}
    assert all(m.w13.dtype == torch.uint8 and m.w13_scale.any() for m in layers)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].output_token_ids) == 4


@pytest.mark.parametrize("model, quantization, gib", [
    ("zai-org/GLM-5.3-Flash", "mxfp4", 167.2), ("zai-org/GLM-5.3-Flash", "compressed-tensors", 176.5),
    ("moonshotai/Kimi-Linear-48B-A3B-Instruct", "mxfp4", 27.2), ("inclusionAI/Ling-3.0-Flash", "mxfp4", 66.9)])
def test_the_capacity_check_counts_4bit_experts_at_their_bytes(model, quantization, gib, monkeypatch):
    """The released shapes with 4-bit experts (a half byte per value, a scale byte per group with each
    row's scales padded to 16 bytes, NVFP4's fp32 per row): GLM-5.3-Flash in ~180 GB (two H200s
    instead of five in bf16), Kimi-Linear on one H100."""
    import math

    from kdaserve.models import capacity
    from kdaserve.models.families import family_of_config
    from kdaserve.models.fp4 import dummy_quantization_config
    from kdaserve.models.loader import resolve_model

    config = resolve_model(model, "dummy", tokenizer=False)[0]
    config.extra["quantization_config"] = dummy_quantization_config(quantization)
    family = family_of_config(config)
    shapes = family.shapes(config)
    group = family.fp4_tensors(config, shapes, "cpu", None)
    seen = {}
    monkeypatch.setattr(capacity, "weights_fit_error", lambda *a, **kw: seen.update(kw) or None)
    capacity.check_weights_fit(model, shapes, torch.bfloat16, "cpu", fp4=group)
    need = (capacity.parameter_count(shapes) - seen["fp4_params"]) * 2 + seen["fp4_bytes"]
    assert abs(need / 2**30 - gib) < 0.1
    assert seen["fp4_params"] == sum(math.prod(s) for n, s in shapes.items() if ".experts." in n and "shared" not in n)
    monkeypatch.undo()
    if model.startswith("zai-org"):
        message = capacity.weights_fit_error(model, capacity.parameter_count(shapes), torch.bfloat16, 141 * 2**30,
                                             fp4_params=seen["fp4_params"], fp4_bytes=seen["fp4_bytes"])
        assert "in 4 bits" in message and "at least 2" in message and "FP8 weights would" not in message


def _pop(suffix):
    def mutate(t):
        t.pop(next(k for k in sorted(t) if k.endswith(suffix)))
    return mutate


def _negate(suffix):
    def mutate(t):   # e4m3 block scales made negative (their sign bit set)
        name = next(k for k in sorted(t) if k.endswith(suffix))
        t[name] = (-t[name].float().abs().clamp_min(2.0**-9)).to(torch.float8_e4m3fn)
    return mutate


@pytest.mark.parametrize("policy", ["keep", "dequantize"])
@pytest.mark.parametrize("case, mutate, match", [
    ("kimi-quark", _pop(".w1.weight_scale"), r"(4-bit layers lack tensors of their scheme.*w1': \['weight_scale'\]|"
                                             r"lacks 1 tensors of this config, e.g. \['.*w1\.weight_scale'\])"),
    ("kimi-nvfp4", _pop(".w2.weight_global_scale"), r"(lack tensors.*w2': \['weight_global_scale'\]|"
                                                    r"lacks 1 tensors.*w2\.weight_global_scale)"),
    ("kimi-quark", lambda t: t.__setitem__("model.layers.1.self_attn.q_proj.weight",
                                           torch.zeros(64, 32, dtype=torch.uint8)),
     r"self_attn\.q_proj\.weight holds packed 4-bit codes, but the checkpoint's quantization_config does not quantize"),
    ("kimi-quark", lambda t: t.__setitem__(next(k for k in sorted(t) if k.endswith(".w3.weight_scale")),
                                           torch.full_like(t[next(k for k in sorted(t) if k.endswith(".w3.weight_scale"))],
                                                           255)),
     r"MXFP4 scale is NaN \(e8m0 code 255\)"),
    ("kimi-nvfp4", _negate(".w1.weight_scale"), r"NVFP4 block scale has its sign bit set .* unsigned e4m3 \(UE4M3\)"),
])
def test_bad_and_partial_checkpoints_are_named(tmp_path, monkeypatch, case, mutate, match, policy):
    monkeypatch.setenv("KDASERVE_FP4_WEIGHTS", policy)
    fp4, _ = write_pair(tmp_path, case, mutate)
    with pytest.raises(ValueError, match=match):
        LLM(str(fp4), **REF)


def test_an_unknown_scheme_names_the_scheme_and_the_layer(tmp_path):
    fp4, _ = write_pair(tmp_path, "kimi-quark")
    d = json.loads((fp4 / "config.json").read_text())
    d["quantization_config"]["global_quant_config"]["weight"] = {"dtype": "int4", "qscheme": "per_group", "group_size": 128}
    (fp4 / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w\d: Quark scheme .*int4.* "
                                         r"is not one kdaserve loads"):
        LLM(str(fp4), **REF)


# ---- the formats' definitions --------------------------------------------------------------------

def test_e2m1_codes_round_to_nearest_ties_to_even_and_saturate():
    x = torch.tensor([0.0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.25, -0.3, -6.5, -1.25, 1e9])
    got = e2m1_values()[e2m1_codes(x).long()]
    assert got.tolist() == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.0, -0.5, -6.0, -1.0, 6.0]
    assert e2m1_codes(torch.tensor([-0.1])).item() == 0          # no negative zero


def test_packing_puts_element_2k_in_the_low_nibble():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert torch.equal(unpack_e2m1(packed), e2m1_values())


def test_scales_at_their_edges():
    zero = torch.zeros(2, 64)
    packed, scale = quantize_mxfp4(zero)
    assert torch.equal(dequantize_mxfp4(packed, scale), zero) and (scale == 0).all()   # 2^-127: zero blocks stay zero
    one = pack_e2m1(torch.full((1, 32), 1, dtype=torch.uint8))                          # every value 0.5
    for code, factor in ((0, 2.0 ** -127), (127, 1.0), (254, 2.0 ** 127)):
        out = dequantize_mxfp4(one, torch.full((1, 1), code, dtype=torch.uint8))
        assert torch.isfinite(out).all() and (out == 0.5 * factor).all()
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(one, torch.full((1, 1), 255, dtype=torch.uint8))
    w = torch.randn(4, 64)
    p, s, g = quantize_nvfp4(w)
    with pytest.raises(ValueError, match="global scale must be finite and non-zero"):
        dequantize_nvfp4(p, s, torch.zeros(1))
    for signed in (-s.float().abs().clamp_min(2.0**-9), torch.full_like(s.float(), -0.0)):   # negative, -0.0
        with pytest.raises(ValueError, match="sign bit set"):
            dequantize_nvfp4(p, signed.to(torch.float8_e4m3fn), g)
    for code, match in ((0x7F, "not finite"), (0xFF, "not finite"), (0x80, "sign bit set"), (0xB8, "sign bit set")):
        with pytest.raises(ValueError, match=match):   # the kept form: e4m3's bits as uint8
            check_nvfp4_scales(torch.tensor([0x38, code], dtype=torch.uint8), None, "w")
    check_nvfp4_scales(torch.arange(0x7F, dtype=torch.uint8), None, "w")   # every unsigned finite code passes
    with pytest.raises(ValueError, match="scales must be uint8 e8m0"):
        dequantize_mxfp4(p, torch.zeros(4, 3, dtype=torch.uint8))
    # Quantization error: at most half the largest gap between neighbouring e2m1 values (4 to 6), times
    # the block's scale; the definitions hold the formats' scale rules (a scale that multiplied by the
    # global scale, or an exponent off by one, breaks these bounds).
    d = dequantize_nvfp4(p, s, g)
    assert ((d - w).abs() <= (s.float() / g).repeat_interleave(16, 1) + 1e-6).all()
    assert (d - w).abs().max() < 0.2 * w.abs().max()
    pm, sm = quantize_mxfp4(w)
    dm = dequantize_mxfp4(pm, sm)
    # MXFP4's rule puts a block's largest value at 4 to 8 x its scale: beyond 6 it saturates (OCP MX).
    assert ((dm - w).abs() <= 2 * torch.exp2(sm.float() - 127).repeat_interleave(32, 1)).all()
    assert (dm - w).abs().max() < 0.2 * w.abs().max()
