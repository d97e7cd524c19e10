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
    with pytest.raises(ValueError, match="model_type 'mamba2'.*known: kimi_linear, glm5_next, bailing_hybrid, kda_hybrid"):
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


def test_a_released_shape_too_large_for_the_host_says_so_before_building(monkeypatch):
    """On a CPU the weights are checked against the host memory available (the kernel would kill
    the process partway through building Kimi-Linear-48B's 91 GiB of bf16 weights, silently)."""
    import time

    import kdaserve.models.capacity as capacity
    from kdaserve.engine import LLM

    monkeypatch.setattr(capacity, "host_memory_available", lambda: 20 * 2**30)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"Kimi-Linear-48B-A3B-Instruct has 4\d\.\dB parameters: \d+ GiB of weights in "
                                         r"bfloat16, but this machine has 20.0 GiB of memory available, so it cannot run "
                                         r"the model on its CPU"):
        LLM("moonshotai/Kimi-Linear-48B-A3B-Instruct", load_format="dummy", device="cpu", dtype="bfloat16")
    assert time.perf_counter() - t0 < 30
    assert capacity.weights_fit_error("small", 10**9, torch.bfloat16, 20 * 2**30, host=True) is None
