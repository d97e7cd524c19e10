"""The layers' 4-bit forms refuse what does not fit them, saying what would: 4-bit linear layers
(layers/linear.py), a MoE layer's 4-bit expert pieces (layers/moe.py), the fused path's exclusive
options (ops/moe/fused.py) and the KDASERVE_FP4_WEIGHTS policy (models/fp4.py)."""

from __future__ import annotations

import os

import pytest
import torch

from kdaserve.layers.linear import Fp4Linear, MergedLinear
from kdaserve.layers.moe import MoEMLP
from kdaserve.ops.moe import RouterConfig


def test_4bit_linears_refuse_inputs_their_groups_do_not_divide_and_unpacked_shards():
    with pytest.raises(ValueError, match=r"a 4-bit \(mxfp4\) weight of 48 inputs: the inputs must be a multiple of 32"):
        Fp4Linear(48, 16, "mxfp4")
    merged = MergedLinear(32, [16, 16], fp4="nvfp4")
    merged.load_shard("weight_global_scale", 1, torch.tensor([2.0]))
    assert (merged.weight_global_scale[16:] == 2.0).all()
    with pytest.raises(ValueError, match=r"shard 0's weight_global_scale must be one value, got \[2\]"):
        merged.load_shard("weight_global_scale", 0, torch.ones(2))
    with pytest.raises(ValueError, match=r"shard 0 of a 4-bit weight's weight arrived as torch.float32; it must come packed"):
        merged.load_shard("weight", 0, torch.zeros(16, 16))


def test_4bit_expert_pieces_are_named_when_they_do_not_fit():
    plain = MoEMLP(32, RouterConfig(4, 2), 32)
    with pytest.raises(ValueError, match=r"expert 1 w1.weight_scale: these experts are not 4-bit"):
        plain.load_expert(1, "w1", torch.zeros(32, 1, dtype=torch.uint8), piece="weight_scale")
    mx = MoEMLP(32, RouterConfig(4, 2), 32, fp4="mxfp4")
    with pytest.raises(ValueError, match=r"MXFP4 experts take weight, weight_scale$"):
        mx.load_expert(0, "w2", torch.ones(1), piece="weight_global_scale")
    with pytest.raises(ValueError, match=r"expert 0 w1.weight arrived as torch.float32; 4-bit experts take packed uint8"):
        mx.load_expert(0, "w1", torch.zeros(32, 16), piece="weight")
    with pytest.raises(ValueError, match=r"expert 0 w3.weight_scale must be \[32, 1\], got \[32, 2\]"):
        mx.load_expert(0, "w3", torch.zeros(32, 2, dtype=torch.uint8), piece="weight_scale")
    nv = MoEMLP(32, RouterConfig(4, 2), 32, fp4="nvfp4")
    with pytest.raises(ValueError, match=r"expert 2 w2.weight_global_scale must be one value, got \[2\]"):
        nv.load_expert(2, "w2", torch.ones(2), piece="weight_global_scale")
    nv.load_expert(2, "w2", torch.tensor([4.0]), piece="weight_global_scale")
    assert (nv.w2_divisor[2] == 4.0).all()


def test_a_shared_expert_and_skipped_choices_are_refused_together():
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, w2 = torch.zeros(2, 32, 16), torch.zeros(2, 16, 16)
    with pytest.raises(ValueError, match="exclude each other: pass the shared expert's output as `addend` instead"):
        moe_experts_fused(torch.zeros(3, 16), w13, w2, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long),
                          shared=(torch.zeros(32, 16), torch.zeros(16, 16)), skip_expert=True)


def test_the_fp4_policy_names_its_values(monkeypatch):
    from kdaserve.models.fp4 import fp4_policy

    monkeypatch.setenv("KDASERVE_FP4_WEIGHTS", "auto")
    with pytest.raises(ValueError, match=r"KDASERVE_FP4_WEIGHTS='auto': expected keep .* or dequantize"):
        fp4_policy()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("T", [10, 70], ids=["decode: shared as an expert", "prefill: shared in the sum"])
def test_a_4bit_layer_runs_its_4bit_shared_expert_as_one_more_expert(scheme, T, monkeypatch):
    """MoEMLP with 4-bit routed and shared experts on the Triton backend against the reference
    backend: at decode sizes the shared expert joins the fused kernels as expert E (its own 4-bit
    tensors), past them its output joins the routed experts' sum; a shared expert in full precision
    beside 4-bit routed experts stays apart."""
    import kdaserve.ops.moe.fused as fused
    from kdaserve.layers.moe import SHARED_AS_EXPERT_MAX_TOKENS

    router = RouterConfig(8, 2, routed_scaling_factor=2.5)
    layers = [MoEMLP(64, router, 32, num_shared_experts=1, backend=b, dtype=torch.float32, fp4=scheme, shared_fp4=scheme)
              for b in ("triton", "reference")]
    g = torch.Generator().manual_seed(5)
    for name, p in layers[0].named_parameters():
        if p.dtype == torch.uint8 and "scale" in name:   # scale codes near 1: e8m0 around 127, e4m3 around 1.0
            low, high = (122, 128) if scheme == "mxfp4" else (48, 64)
            p.copy_(torch.randint(low, high, p.shape, generator=g).to(torch.uint8))
        elif p.dtype == torch.uint8:
            p.copy_(torch.randint(0, 256, p.shape, generator=g).to(torch.uint8))
        else:
            p.copy_(torch.rand(p.shape, generator=g) * 4 + 8 if "global" in name or "divisor" in name   # NVFP4's divisors
                    else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    layers[1].load_state_dict(layers[0].state_dict())
    calls = []
    run = fused.moe_experts_fused
    monkeypatch.setattr(fused, "moe_experts_fused", lambda *a, **kw: calls.append(kw) or run(*a, **kw))
    x = torch.randn(T, 64, generator=g)
    want = layers[1](x)
    torch.testing.assert_close(layers[0](x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    as_expert = T <= SHARED_AS_EXPERT_MAX_TOKENS
    assert [("shared" in kw, "addend" in kw) for kw in calls] == [(as_expert, not as_expert)]
    apart = MoEMLP(64, router, 32, num_shared_experts=1, backend="triton", dtype=torch.float32, fp4=scheme)
    assert apart.shared_as_expert(1) is None and layers[0].shared_as_expert(1) is not None
