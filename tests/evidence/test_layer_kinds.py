"""kdaserve/evidence/layer_kinds.py: every kernel a Kimi-Linear step launches lands in its layer kind,
and each kind's decode floor counts the bytes its layers hold, computed here from the config."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from kdaserve.evidence.layer_kinds import (
    ALL_KINDS,
    GEMM,
    KDA,
    MLA,
    MOE,
    OTHER,
    decode_floor_bytes,
    device_launches,
    device_ms_by_kernel,
    device_ms_by_kind,
    experts_touched,
    kind_of,
)
from kdaserve.models.builtin import released_config
from kdaserve.models.loader import load_model

# The kernels of ours that belong to no kind with a floor: norms, SwiGLU, routing, quantization.
OTHER_OK = {"rms_norm_kernel", "swiglu_kernel", "_route_kernel", "_quantize_group_kernel"}


@pytest.mark.parametrize("name, kind", [
    ("_moe_gate_up_kernel", MOE), ("_moe_sum_kernel", MOE), ("_align_count_kernel", MOE), ("_align_per_expert_kernel", MOE),
    ("_mla_decode_kernel", MLA), ("_mla_merge_kernel", MLA), ("_mla_prefill_kernel", MLA), ("mla_latent_write_kernel", MLA),
    ("kda_fused_decode_kernel", KDA), ("conv_update_kernel", KDA), ("flash_prepare_kernel", KDA),
    ("gated_rms_norm_kernel", KDA), ("rms_norm_kernel", OTHER), ("_route_kernel", OTHER),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT", GEMM), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", GEMM),
    # cuBLAS names carry "align8": still a GEMM, not the MoE alignment
    ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8", GEMM), ("_block_fp8_gemm_kernel", GEMM),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, fl", GEMM),
    ("void at::native::elementwise_kernel<128, 4>(int, Fn)", OTHER),
])
def test_kernel_names_land_in_their_kind(name, kind):
    assert kind_of(name) == kind


def test_every_kernel_a_kimi_linear_step_launches_has_its_kind(monkeypatch):
    """The tiny Kimi-Linear through the engine on its Triton paths (flash prefill, fused decode,
    MLA and MoE kernels), every launch recorded: none of ours falls into "other" unless listed."""
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("records launches through Triton's interpreter")
    import triton.runtime.interpreter as interpreter

    from kdaserve.engine import LLM, SamplingParams

    launched: set[str] = set()
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, **kwargs):
        launched.add(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording)
    llm = LLM("kimi-tiny", kda_prefill_backend="flash", kda_decode_backend="fused", mla_backend="triton",
              moe_backend="triton", max_num_seqs=2, max_model_len=64, dtype="float32")
    llm.generate(["The quick brown fox"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    kinds = {name: kind_of(name) for name in launched}
    assert {MOE, MLA, KDA} <= set(kinds.values()), kinds
    assert {n for n, k in kinds.items() if k == OTHER} <= OTHER_OK, kinds


def test_device_time_sums_per_kind_and_names_the_rest():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, us, dev=cuda: SimpleNamespace(name=name, device_type=dev, device_time_total=us)  # noqa: E731
    out, other = device_ms_by_kind([ev("_moe_down_kernel", 300.0), ev("_moe_gate_up_kernel", 700.0),
                                    ev("rms_norm_kernel", 50.0), ev("rms_norm_kernel", 25.0),
                                    ev("nvjet_x", 2000.0), ev("aten::mm", 9999.0, cpu)])
    assert (out[MOE], out[GEMM], out[OTHER], out[MLA], out[KDA]) == pytest.approx((1.0, 2.0, 0.075, 0.0, 0.0))
    assert out["total"] == pytest.approx(3.075) and set(out) == set(ALL_KINDS) | {"total"}
    assert other == {"rms_norm_kernel": pytest.approx(0.075)}
    assert device_launches([ev("_moe_down_kernel", 1.0), ev("aten::mm", 1.0, cpu), ev("Memcpy DtoH", 1.0)]) == 2
    ms, launches = device_ms_by_kernel([ev("rms_norm_kernel", 50.0), ev("nvjet_x", 2000.0), ev("rms_norm_kernel", 25.0),
                                        ev("aten::mm", 9999.0, cpu)])
    assert ms == {"rms_norm_kernel": pytest.approx(0.075), "nvjet_x": pytest.approx(2.0)}
    assert launches == {"rms_norm_kernel": 2, "nvjet_x": 1}


def test_experts_touched_spans_k_to_all():
    assert experts_touched(256, 8, 1) == pytest.approx(8)
    assert experts_touched(256, 8, 10_000) == pytest.approx(256)
    assert 200 < experts_touched(256, 8, 64) < 230   # the ~222 of perf-notes' batch 64


@pytest.mark.parametrize("tied", [False, True])
def test_decode_floor_counts_each_kind_from_the_config(tied):
    """Floors of the tiny Kimi-Linear recomputed from its config alone: experts by their shapes,
    latent rows by kv_lora_rank + rope, KDA states by heads, head dim and conv width, and the dense
    weights as all parameters less embedding and experts (plus the head when tied)."""
    loaded = load_model("kimi-tiny", dtype=torch.float32, device="cpu", mla_backend="reference",
                        moe_backend="reference")
    model = loaded.model
    if tied:   # the head reads the embedding's weight: it is still read whole by a decode step
        model.lm_head.weight = model.model.embed_tokens.weight
    c = model.config
    B, ctx, f32 = 5, 37, 4
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    mla_layers = sum(t == "full_attention" for t in c.layer_types)
    kda_layers = sum(t == "linear_attention" for t in c.layer_types)
    E, k, h, I = c.num_local_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    want_moe = moe_layers * experts_touched(E, k, B) * 3 * h * I * f32
    want_mla = B * ctx * mla_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * f32
    H, D = c.linear_num_heads, c.linear_head_dim
    conv_window = (c.linear_conv_kernel_dim - 1) * 3 * H * D   # q, k, v channels, the last K-1 tokens
    want_kda = 2 * B * kda_layers * (H * D * D + conv_window) * f32
    every = sum(p.nbytes for p in model.parameters())
    want_gemm = every - moe_layers * E * 3 * h * I * f32 - c.vocab_size * h * f32 + (c.vocab_size * h * f32 if tied else 0)
    f = decode_floor_bytes(model, B, ctx, torch.float32)
    assert f[MOE] == pytest.approx(want_moe) and f[MLA] == want_mla and f[KDA] == want_kda and f[GEMM] == want_gemm
    assert f["experts_touched"] == pytest.approx(experts_touched(E, k, B))


def test_a_shared_expert_run_by_the_moe_kernels_counts_as_moe():
    """On the Triton MoE backend a decode-sized step runs the shared expert inside the MoE kernels
    (layers/moe): its bytes move from the GEMMs' floor to MoE's, the total unchanged; a larger step
    keeps them with the GEMMs."""
    from kdaserve.layers.moe import SHARED_AS_EXPERT_MAX_TOKENS

    kw = dict(dtype=torch.float32, device="cpu", mla_backend="reference")
    ref = load_model("kimi-tiny", moe_backend="reference", **kw).model
    tri = load_model("kimi-tiny", moe_backend="triton", **kw).model
    c = ref.config
    shared = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers)) * 3 * c.hidden_size * c.moe_intermediate_size * 4
    for B, inside in ((5, True), (SHARED_AS_EXPERT_MAX_TOKENS + 1, False)):
        a, b = decode_floor_bytes(ref, B, 9, torch.float32), decode_floor_bytes(tri, B, 9, torch.float32)
        moved = shared if inside else 0
        assert b[MOE] == pytest.approx(a[MOE] + moved) and b[GEMM] == a[GEMM] - moved, (B, a, b)


def test_released_kimi_linear_decode_floor_at_batch_64():
    """At the real shape, bf16 (meta device: no memory): 3.3 GB of dense weights (with 8 experts a
    layer, the 6.2 GB of perf-notes' batch 1), ~82 GB of experts at batch 64 (~222 of 256 per layer),
    41.4 MiB of KDA state per sequence."""
    from kdaserve.backends import KDABackendChoice
    from kdaserve.models.causal_lm import kda_backends_for
    from kdaserve.models.kimi_linear import KimiLinearForCausalLM

    c = released_config("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    pair = kda_backends_for(c, KDABackendChoice(), torch.bfloat16, "meta")
    model = KimiLinearForCausalLM(c, kda_backends=pair, mla_backend="reference", moe_backend="reference",
                                  dtype=torch.bfloat16, device="meta")
    f = decode_floor_bytes(model, 64, 528, torch.bfloat16)
    assert 3.2e9 < f[GEMM] < 3.4e9 and 80e9 < f[MOE] < 84e9, f
    assert f[KDA] == pytest.approx(2 * 64 * 41.4 * 2**20, rel=1e-3)
    assert f[MLA] == 64 * 528 * 7 * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
