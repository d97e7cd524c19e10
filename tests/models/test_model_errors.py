"""Startup errors of model loading and kernel choice say what was wrong and what would be right."""

from __future__ import annotations

import json

import pytest
import torch

from kdaserve.engine.config import EngineConfig
from kdaserve.layers.kernel_choice import resolve_kernel_choice
from kdaserve.models.loader import load_model


def test_a_released_name_without_weights_asks_for_a_directory_or_dummy():
    with pytest.raises(ValueError, match="pass its checkpoint directory as --model, or --load-format dummy"):
        load_model("moonshotai/Kimi-Linear-48B-A3B-Instruct", dtype=torch.float32, device="cpu")


def test_an_unknown_model_type_names_the_known_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2", "hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type 'mamba2'.*known: kimi_linear, glm5_next, kda_hybrid"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")


def test_load_format_and_kernel_choices_are_checked():
    with pytest.raises(ValueError, match="invalid load_format: got 'pt'; expected auto, safetensors or dummy"):
        EngineConfig(load_format="pt", device="cpu")
    with pytest.raises(ValueError, match="unknown MoE backend 'cutlass'; expected one of auto, reference, triton"):
        resolve_kernel_choice("MoE", "cutlass", torch.device("cpu"))
    assert resolve_kernel_choice("MLA", "auto", torch.device("cpu")) == "reference"


def test_triton_on_a_cpu_without_the_interpreter_says_what_is_needed(monkeypatch):
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="needs a CUDA or ROCm device, or TRITON_INTERPRET=1 on the CPU"):
        resolve_kernel_choice("MLA", "triton", torch.device("cpu"))
