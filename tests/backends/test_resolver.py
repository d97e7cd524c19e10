"""The resolver: unknown names, every unmet requirement listed, `auto` per platform, `info`'s table.

Machines are described, not detected, so every platform is tested here on the CPU.
"""

import logging

import pytest
import torch

from kdaserve.backends import (
    AUTO_ORDER,
    BackendSpec,
    BackendUnavailableError,
    LayerSettings,
    Machine,
    UnknownBackendError,
    backend_names,
    check_backend,
    choose_auto,
    describe_backends,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from kdaserve.backends import requirements as rq
from kdaserve.backends.registry import get_spec

OURS = {"kdaserve.ops.kda.flash": "", "kdaserve.ops.kda.chain": "", "kdaserve.ops.kda.fused": "", "kdaserve.ops.kda.conv": ""}
H200 = Machine("cuda", cuda_capability=(9, 0), modules={"triton": "3.6.0", "fla": "0.6.0", "einops": "0.8.1", **OURS})
H200_ALL = Machine("cuda", cuda_capability=(9, 0), modules={**H200.modules, "flash_kda": "0.1.0"})
MI355 = Machine("rocm", rocm_arch="gfx950", modules={
    "triton": "3.6.0", "aiter": "0.1.9", "aiter.ops.triton.attention.kda": "", "aiter.ops.triton.attention.chunk_kda": "", **OURS,
})
MI300 = Machine("rocm", rocm_arch="gfx942", modules={"triton": "3.6.0", **OURS})
CPU = Machine("cpu", modules={"triton": "3.6.0", **OURS})
CPU_INTERP = Machine("cpu", triton_interpret=True, modules={"triton": "3.6.0", **OURS})
GPU_LAYER = LayerSettings()  # bf16, head 128, bounded, fp32 state, SD, no speculation
CPU_LAYER = LayerSettings(input_dtype=torch.float32)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_unknown_name_lists_the_valid_names(phase):
    with pytest.raises(UnknownBackendError) as err:
        resolve_backend(phase, "flashh", GPU_LAYER, H200)
    msg = str(err.value)
    assert "'flashh'" in msg
    for name in ("auto",) + backend_names(phase):
        assert name in msg


def test_backend_names_are_the_issue_lists():
    assert backend_names("prefill") == ("reference", "flash", "fla", "flashkda", "aiter")
    assert backend_names("decode") == ("reference", "chain", "fused", "adaptive", "fla", "aiter")


def test_explicit_backend_lists_every_unmet_requirement():
    """flashkda on a CPU with fp32 inputs, head 64, unbounded gate, bf16-free machine: all of it, at once."""
    settings = LayerSettings(input_dtype=torch.float32, head_dim=64, lower_bound=None, state_dtype=torch.float16)
    with pytest.raises(BackendUnavailableError) as err:
        resolve_backend("prefill", "flashkda", settings, CPU)
    msg, unmet = str(err.value), err.value.unmet
    expected = ["platform CUDA", "compute capability >= 9.0", "package `flash_kda`", "input dtype bfloat16",
                "head size 128", "bounded (lower_bound) gate", "recurrent-state dtype float32 or bfloat16"]
    assert len(unmet) == len(expected), unmet
    for needle, line in zip(expected, unmet):
        assert needle in line
        assert line in msg
    assert "7 unmet requirements" in msg


def test_decode_backends_declare_what_their_entry_points_refuse():
    """What an entry point refuses at its first call must be a requirement, so a layer fails at
    startup (or auto passes the backend over) instead of at its first decode step: the fused
    kernel is written for width-4 convs; both Triton decodes check lower_bound in [-5, 0)."""
    w3 = LayerSettings(conv_width=3)
    with pytest.raises(BackendUnavailableError, match="conv width 4"):
        resolve_backend("decode", "fused", w3, H200)
    assert check_backend("decode", "chain", w3, H200) == []
    assert choose_auto("decode", w3, H200)[0] == "chain"
    # adaptive may run either kernel, so it needs what both need (here: fused's conv width).
    with pytest.raises(BackendUnavailableError, match="conv width 4"):
        resolve_backend("decode", "adaptive", w3, H200)
    deep = LayerSettings(lower_bound=-6.0)
    for name in ("chain", "fused", "adaptive"):
        assert any("lower_bound in [-5.0, 0.0)" in u for u in check_backend("decode", name, deep, H200)), name


def test_explicit_backend_that_can_run_is_loaded():
    r = resolve_backend("decode", "reference", CPU_LAYER, CPU)
    from kdaserve.ops.kda.reference import kda_decode_reference

    assert r.name == "reference" and r.requested == "reference" and r.fn is kda_decode_reference
    assert not r.graph_capturable


def test_triton_backends_need_a_gpu_or_the_interpreter():
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        resolve_backend("decode", "chain", CPU_LAYER, CPU)
    name, _ = choose_auto("decode", CPU_LAYER, CPU_INTERP)
    assert name == "reference"  # auto prefers the reference on the CPU even with the interpreter on
    assert check_backend("decode", "chain", CPU_LAYER, CPU_INTERP) == []  # but it can run there


def test_interpreter_refuses_bf16_for_tl_dot_backends():
    settings = LayerSettings(input_dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="interpreter"):
        resolve_backend("prefill", "flash", settings, CPU_INTERP)


@pytest.mark.parametrize(
    "machine, settings, prefill, decode",
    [
        (H200, GPU_LAYER, "flash", "adaptive"),
        (H200_ALL, GPU_LAYER, "flash", "adaptive"),
        (MI355, GPU_LAYER, "aiter", "aiter"),
        (MI300, GPU_LAYER, "flash", "fused"),
        (CPU, CPU_LAYER, "reference", "reference"),
        (CPU_INTERP, CPU_LAYER, "reference", "reference"),
        # head size 256: flash (its declaration) and fused (state in registers) stop at 128.
        (H200, LayerSettings(head_dim=256), "fla", "chain"),
        # head size 48 (not a power of two): only the reference.
        (H200, LayerSettings(head_dim=48), "reference", "reference"),
        # fp16 state: only the reference takes it.
        (H200, LayerSettings(state_dtype=torch.float16), "reference", "reference"),
        # bf16 state on ROCm: aiter is fp32-state only.
        (MI355, LayerSettings(state_dtype=torch.bfloat16), "flash", "fused"),
    ],
)
def test_auto_picks_the_fastest_eligible_backend_per_platform(machine, settings, prefill, decode):
    assert choose_auto("prefill", settings, machine)[0] == prefill
    assert choose_auto("decode", settings, machine)[0] == decode


def test_auto_without_our_kernels_falls_to_fla_then_reference():
    no_ours = Machine("cuda", cuda_capability=(9, 0), modules={"triton": "3.6.0", "fla": "0.6.0", "einops": "0.8",
                                                               "kdaserve.ops.kda.conv": ""})
    name, skipped = choose_auto("prefill", GPU_LAYER, no_ours)
    assert name == "fla"
    assert [s.split(":")[0] for s in skipped] == ["flash"]
    old_fla = Machine("cuda", cuda_capability=(9, 0), modules={"triton": "3.6.0", "fla": "0.5.1", "einops": "0.8"})
    name, skipped = choose_auto("decode", GPU_LAYER, old_fla)
    assert name == "reference"
    assert any("version 0.5.1 is installed" in s for s in skipped)


def test_auto_orders_match_the_issue():
    assert AUTO_ORDER["cuda"] == {"prefill": ("flash", "fla", "reference"),
                                  "decode": ("adaptive", "fused", "chain", "fla", "reference")}
    assert AUTO_ORDER["cpu"] == {"prefill": ("reference",), "decode": ("reference",)}
    assert AUTO_ORDER["rocm"]["prefill"][0] == "aiter" and AUTO_ORDER["rocm"]["decode"][0] == "aiter"


def test_the_loader_resolves_one_pair_logs_it_once_and_every_layer_holds_it(caplog):
    from kdaserve.models.loader import load_model

    with caplog.at_level(logging.INFO, logger="kdaserve.backends"):
        loaded = load_model("tiny", dtype=torch.float32, device="cpu")
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("KDA backends:")]
    assert len(lines) == 1 and "prefill reference (asked auto), decode reference (asked auto)" in lines[0]
    assert len(loaded.model.kda_layers) > 1
    for layer in loaded.model.kda_layers:  # the same resolved object, not one resolution per layer
        assert layer.backends is loaded.kda_backends
        assert layer.settings is loaded.kda_backends.settings and layer.head_dim == loaded.kda_backends.settings.head_dim


def test_a_model_with_kda_layers_needs_their_pair():
    from kdaserve.models.builtin import builtin_config
    from kdaserve.models.hybrid import HybridForCausalLM

    with pytest.raises(ValueError, match=r"has KDA layers: pass kda_backends=kda_backends_for"):
        HybridForCausalLM(builtin_config("tiny"), kda_backends=None, dtype=torch.float32, device="cpu")


def test_a_layer_refuses_backends_resolved_for_other_heads():
    from kdaserve.backends import KDABackendChoice, resolve_kda_backends
    from kdaserve.layers.kda import KDALayer

    pair = resolve_kda_backends(KDABackendChoice("reference", "reference"), LayerSettings(input_dtype=torch.float32, head_dim=8),
                                4, CPU)
    with pytest.raises(ValueError, match="resolved for 4 heads, but this layer has 2 on rank 0 of 1"):
        KDALayer(32, 2, pair, device="cpu")
    with pytest.raises(ValueError, match="resolved for 4 heads, but this layer has 2 on rank 1 of 2"):
        KDALayer(32, 4, pair, tp_rank=1, tp_size=2, device="cpu")
    assert KDALayer(32, 4, pair, device="cpu").num_heads == 4


def test_describe_backends_covers_every_backend_of_both_phases():
    rows = describe_backends(CPU)
    assert [(r["phase"], r["name"]) for r in rows] == [("prefill", n) for n in backend_names("prefill")] + [
        ("decode", n) for n in backend_names("decode")
    ]
    for r in rows:
        assert set(r) == {"phase", "name", "runnable", "unmet"}
        assert r["runnable"] == (not r["unmet"])
    runnable = {(r["phase"], r["name"]) for r in rows if r["runnable"]}
    assert runnable == {("prefill", "reference"), ("decode", "reference")}
    on_h200 = {(r["phase"], r["name"]) for r in describe_backends(H200) if r["runnable"]}
    assert ("prefill", "flash") in on_h200 and ("decode", "fused") in on_h200 and ("prefill", "flashkda") not in on_h200


def test_describe_backends_default_settings_per_platform():
    assert LayerSettings.defaults_for(CPU).input_dtype == torch.float32
    assert LayerSettings.defaults_for(H200) == LayerSettings(torch.bfloat16, 128, -5.0, torch.float32, "SD", 0)


def test_registered_backend_resolves_and_unregisters():
    spec = BackendSpec("toy", "decode", "test", lambda: "toy-fn", lambda: (rq.head_dims(64),))
    register_backend(spec)
    try:
        assert resolve_backend("decode", "toy", LayerSettings(head_dim=64), CPU).fn == "toy-fn"
        with pytest.raises(BackendUnavailableError, match="head size 64"):
            resolve_backend("decode", "toy", LayerSettings(head_dim=32), CPU)
    finally:
        unregister_backend("decode", "toy")
    with pytest.raises(UnknownBackendError):
        resolve_backend("decode", "toy", LayerSettings(head_dim=64), CPU)


def test_import_failure_of_an_eligible_backend_is_an_error_not_a_fallback():
    def broken():
        raise ImportError("no module named kdaserve.ops.toy")

    register_backend(BackendSpec("toy", "prefill", "test", broken, lambda: ()))
    try:
        with pytest.raises(BackendUnavailableError, match="failed to import"):
            resolve_backend("prefill", "toy", CPU_LAYER, CPU)
    finally:
        unregister_backend("prefill", "toy")


def test_auto_passes_over_a_backend_that_fails_to_import_with_a_warning(caplog, monkeypatch):
    from kdaserve.backends import registry

    def broken():
        raise ImportError("kdaserve.ops.toy is half written")

    register_backend(BackendSpec("toy", "decode", "test", broken, lambda: ()))
    monkeypatch.setitem(registry.AUTO_ORDER, "cpu", {"prefill": ("reference",), "decode": ("toy", "reference")})
    try:
        with caplog.at_level(logging.INFO, logger="kdaserve.backends"):
            r = resolve_backend("decode", "auto", LayerSettings(input_dtype=torch.float32, head_dim=40), CPU)
    finally:
        unregister_backend("decode", "toy")
    assert r.name == "reference"
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "half written" in warnings[0].getMessage()
    assert any("toy: failed to import" in rec.getMessage() for rec in caplog.records if rec.levelno == logging.INFO)


@pytest.mark.parametrize("phase,name,op", [("prefill", "flash", "flash"),
                                           ("decode", "chain", "chain"), ("decode", "fused", "fused")])
def test_declared_requirements_and_the_runtime_check_agree(phase, name, op):
    """The registry derives a Triton backend's requirements from kdaserve/ops/kda/limits.py, and the
    op checks its inputs against the same limits: for every head size, dtype, gate and conv width,
    the startup verdict and the runtime verdict are the same."""
    from kdaserve.ops.kda.limits import BY_OP

    limits, reqs = BY_OP[op], get_spec(phase, name).requirements()
    for D in (4, 8, 16, 32, 48, 64, 96, 128, 256, 512):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for lb in (-5.0, -1.0, None, -6.0, 0.0):
                for W in (2, 4):
                    settings = LayerSettings(input_dtype=dtype, head_dim=D, lower_bound=lb, conv_width=W)
                    declared_ok = not rq.unmet_requirements(reqs, H200, settings)
                    try:
                        limits.check(head_dim=D, lower_bound=lb, input_dtype=dtype, conv_width=W)
                        runtime_ok = True
                    except ValueError:
                        runtime_ok = False
                    assert declared_ok == runtime_ok, (D, dtype, lb, W)
