"""Each requirement builder says "met" on a machine/layer that has it and names the gap on one
that does not: every check can fail."""

import pytest
import torch

from kdaserve.backends import LayerSettings, Machine
from kdaserve.backends import requirements as rq

L = LayerSettings()
CUDA90 = Machine("cuda", cuda_capability=(9, 0), modules={"triton": "3.6.0", "fla": "0.6.0", "pkg.sub.mod": ""})
CUDA80 = Machine("cuda", cuda_capability=(8, 0), modules={"triton": "3.2.0"})
GFX950 = Machine("rocm", rocm_arch="gfx950", modules={})
CPU = Machine("cpu", modules={})
CPU_I = Machine("cpu", triton_interpret=True, modules={})

CASES = [
    # requirement, (machine, settings) meeting it, (machine, settings) failing it, words of the failure
    (rq.platform("cuda", "rocm", triton_interpreter=True), (CPU_I, L), (CPU, L), "CPU without TRITON_INTERPRET=1"),
    (rq.platform("rocm"), (GFX950, L), (CUDA90, L), "runs on CUDA sm_90"),
    (rq.min_cuda_capability(9, 0), (CUDA90, L), (CUDA80, L), "sm_80"),
    (rq.rocm_arch("gfx950"), (GFX950, L), (Machine("rocm", rocm_arch="gfx942", modules={}), L), "gfx942"),
    (rq.package("triton", "3.4"), (CUDA90, L), (CUDA80, L), "version 3.2.0 is installed"),
    (rq.package("fla"), (CUDA90, L), (CUDA80, L), "not installed"),
    (rq.entry_points("pkg.sub.mod"), (CUDA90, L), (CUDA80, L), "missing: pkg.sub.mod"),
    (rq.implementation("kdaserve.ops.toy"), (Machine("cpu", modules={"kdaserve.ops.toy": ""}), L), (CPU, L),
     "not part of this kdaserve"),
    (rq.input_dtypes(torch.bfloat16), (CPU, L), (CPU, LayerSettings(input_dtype=torch.float16)), "inputs are float16"),
    (rq.no_bf16_in_interpreter(), (CUDA90, L), (CPU_I, L), "interpreter"),
    (rq.head_dims(128), (CPU, L), (CPU, LayerSettings(head_dim=64)), "head size is 64"),
    (rq.head_dim_power_of_two(16, 128), (CPU, L), (CPU, LayerSettings(head_dim=96)), "head size is 96"),
    (rq.gates("bounded"), (CPU, L), (CPU, LayerSettings(lower_bound=None)), "gate is unbounded"),
    (rq.gates("unbounded"), (CPU, LayerSettings(lower_bound=None)), (CPU, L), "gate is bounded"),
    (rq.lower_bound_range(-5.0, 0.0), (CPU, L), (CPU, LayerSettings(lower_bound=-6.0)), "lower_bound is -6.0"),
    (rq.state_dtypes(torch.float32), (CPU, L), (CPU, LayerSettings(state_dtype=torch.bfloat16)), "state is bfloat16"),
    (rq.conv_layouts("SD"), (CPU, L), (CPU, LayerSettings(conv_layout="DS")), "layout is DS"),
    (rq.speculative(False), (CPU, L), (CPU, LayerSettings(num_spec_tokens=2)), "2 draft tokens"),
    (rq.unrounded_gate(), (CPU, L), (CPU, LayerSettings(round_gate=True)), "rounds its gate to the activation dtype"),
]


@pytest.mark.parametrize("req, ok, bad, words", CASES, ids=[f"{c[0].kind}-{i}" for i, c in enumerate(CASES)])
def test_requirement_met_and_unmet(req, ok, bad, words):
    assert req.unmet(*ok) is None
    msg = req.unmet(*bad)
    assert msg is not None and msg.startswith(f"needs {req.needs}; ") and words in msg, msg


def test_unmet_requirements_evaluates_all_in_order():
    reqs = [rq.head_dims(128), rq.gates("bounded"), rq.state_dtypes(torch.float32)]
    bad = LayerSettings(head_dim=64, lower_bound=None, state_dtype=torch.bfloat16)
    assert [m.split(";")[0] for m in rq.unmet_requirements(reqs, CPU, bad)] == [f"needs {r.needs}" for r in reqs]


def test_version_parsing():
    assert rq.parse_version("0.6.0") == (0, 6, 0)
    assert rq.parse_version("3.6.0+git1234") == (3, 6, 0)
    assert rq.parse_version("0.5.10.dev3") > rq.parse_version("0.5.9")


def test_probing_imports_nothing_and_finds_submodules_by_file():
    import sys

    m = Machine("cpu")
    assert m.module_version("kdaserve.ops.kda.reference.kda") is not None
    assert m.module_version("kdaserve.ops.no_such_op") is None
    assert m.module_version("no_such_package_kdaserve") is None
    assert "no_such_package_kdaserve" not in sys.modules
    assert m.module_version("torch")  # a version string


def test_detect_cpu_reads_the_interpreter_switch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Machine.detect("cpu").triton_interpret and Machine.detect("cpu").platform == "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not Machine.detect("cpu").triton_interpret


def test_unknown_platform_is_refused():
    with pytest.raises(ValueError, match="platform must be one of"):
        Machine("tpu")
