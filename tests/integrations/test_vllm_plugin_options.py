"""The plugin's options (integrations/vllm/kdaserve_vllm/options.py), without vLLM: when kdaserve is
asked, which phases `auto` leaves to vLLM, and bad settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integrations" / "vllm"))

from kdaserve_vllm.options import ENV_DECODE, ENV_PREFILL, PluginOptions, plugin_options  # noqa: E402


def test_not_asked_means_none(monkeypatch):
    monkeypatch.delenv(ENV_PREFILL, raising=False)
    monkeypatch.delenv(ENV_DECODE, raising=False)
    assert plugin_options(None) is None and plugin_options({"other": 1}) is None


def test_config_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_PREFILL, "flash")
    monkeypatch.setenv(ENV_DECODE, "fused")
    assert plugin_options(None) == PluginOptions("flash", "fused")
    assert plugin_options({"kdaserve": {"decode_backend": "reference"}}) == PluginOptions("flash", "reference")


def test_auto_follows_the_measurements():
    auto = PluginOptions()
    assert not auto.uses_vllm("prefill", "cpu", bounded_gate=False)         # vLLM has no CPU KDA path
    assert auto.uses_vllm("prefill", "cuda", bounded_gate=False)            # unbounded: flash slower than FLA
    assert not auto.uses_vllm("prefill", "cuda", bounded_gate=True)         # bounded: flash 1.6-4.6x
    assert not auto.uses_vllm("decode", "cuda", bounded_gate=False)
    named = PluginOptions("vllm", "fused")
    assert named.uses_vllm("prefill", "cuda", True) and named.kdaserve_choice("prefill") == "auto"


def test_bad_settings_say_what_is_allowed(monkeypatch):
    monkeypatch.delenv(ENV_PREFILL, raising=False)
    with pytest.raises(ValueError, match=r"unknown keys \['prefil_backend'\]"):
        plugin_options({"kdaserve": {"prefil_backend": "flash"}})
    with pytest.raises(ValueError, match="must be strings"):
        plugin_options({"kdaserve": {"prefill_backend": 3}})
    with pytest.raises(ValueError, match="check_nan must be true or false, got 'yes'"):
        plugin_options({"kdaserve": {"check_nan": "yes"}})


def test_the_nan_check_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv(ENV_PREFILL, raising=False)
    monkeypatch.delenv(ENV_DECODE, raising=False)
    assert plugin_options({"kdaserve": {}}).check_nan
    assert not plugin_options({"kdaserve": {"check_nan": False}}).check_nan


def test_a_nan_anywhere_fails_with_the_message_and_finite_tensors_pass():
    import torch

    from kdaserve_vllm.gdn_step import fail_on_nan

    finite = [torch.randn(5, 4), torch.randn(1, 5, 2, 2)]
    fail_on_nan(finite, "never raised")
    for i in range(2):
        poisoned = [t.clone() for t in finite]
        poisoned[i].view(-1)[3] = float("nan")
        with pytest.raises(RuntimeError, match="layer 7 .tp rank 1 of 2, conv state layout SD.: its inputs hold NaN"):
            fail_on_nan(poisoned, "layer 7 (tp rank 1 of 2, conv state layout SD): its inputs hold NaN")
