"""Layers that keep block-scaled FP8 weights (layers/linear.py, layers/moe.py) and the FP8 policy
(models/fp8.py): what they refuse at construction and at load, each error saying what would do."""

from __future__ import annotations

import pytest
import torch

from kdaserve.layers.linear import MergedLinear
from kdaserve.layers.moe import MoEMLP
from kdaserve.ops.fp8.reference import FP8
from kdaserve.ops.moe import RouterConfig


def test_an_fp8_merged_weight_needs_whole_row_blocks_and_quantized_shards():
    with pytest.raises(ValueError, match=r"shards of whole 16-row blocks, got \[16, 24\]"):
        MergedLinear(32, [16, 24], fp8_block=(16, 16))
    lin = MergedLinear(32, [16, 32], fp8_block=(16, 16))
    assert lin.weight.dtype == FP8 and lin.weight_scale_inv.shape == (3, 2)
    with pytest.raises(ValueError, match="arrived as torch.float32; it must come quantized with its weight_scale_inv"):
        lin.load_shard("weight", 1, torch.randn(32, 32))
    lin.load_shard("weight_scale_inv", 1, torch.full((2, 2), 3.0))   # the shard's row blocks only
    assert (lin.weight_scale_inv[1:] == 3).all()


def test_fp8_experts_need_whole_blocks_and_take_only_quantized_weights_and_their_scales():
    router = RouterConfig(4, 2)
    with pytest.raises(ValueError, match=r"expert width \(24\) to be a multiple of the 16-row block"):
        MoEMLP(32, router, 24, fp8_block=(16, 16))
    fp8 = MoEMLP(32, router, 32, fp8_block=(16, 16))
    with pytest.raises(ValueError, match="arrived as torch.float32; FP8 experts take it quantized"):
        fp8.load_expert(0, "w1", torch.randn(32, 32))
    plain = MoEMLP(32, router, 32)
    with pytest.raises(ValueError, match="not FP8, so the scale must be applied at load"):
        plain.load_expert(0, "w1", torch.ones(2, 2), piece="weight_scale_inv")


def test_the_fp8_policy_names_its_choices(monkeypatch):
    from kdaserve.models.fp8 import fp8_policy

    monkeypatch.setenv("KDASERVE_FP8_WEIGHTS", "always")
    with pytest.raises(ValueError, match="KDASERVE_FP8_WEIGHTS='always': expected auto, keep or dequantize"):
        fp8_policy()
