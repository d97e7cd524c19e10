"""What kdaserve chooses on AMD GPUs, checked without one: torch's ROCm reporting is mocked (a
HIP version, a device whose gcnArchName is gfx942, gfx950 or gfx90a)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdaserve.backends import BackendUnavailableError, LayerSettings, Machine, choose_auto, resolve_backend
from kdaserve.ops import precision

OURS = {"kdaserve.ops.kda.flash": "", "kdaserve.ops.kda.chain": "", "kdaserve.ops.kda.fused": "", "kdaserve.ops.kda.conv": ""}


@pytest.fixture
def rocm(monkeypatch):
    """Make torch report a ROCm GPU of the given architecture."""

    def as_gpu(arch: str):
        precision._gpu_target.cache_clear()
        monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d=None: SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-", major=9, minor=4))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 4))

    yield as_gpu
    precision._gpu_target.cache_clear()


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx90a"])
def test_machine_and_precision_follow_the_architecture(rocm, arch):
    rocm(arch)
    m = Machine.detect("cuda:0")
    assert m.platform == "rocm" and m.rocm_arch == arch and m.describe_platform() == f"ROCm {arch}"
    want = {"gfx942": ("tf32", "ieee"), "gfx950": ("bf16x3", "bf16x6"), "gfx90a": ("ieee", "ieee")}[arch]
    p = precision.dot_precision(torch.device("cuda:0"))
    assert (p.tensor_core, p.exact) == want
    from kdaserve.ops.kda.flash.prefill import dot_precisions, use_fast_math

    assert not use_fast_math(torch.device("cuda:0"))          # PTX fast math is never reached on ROCm
    assert dot_precisions(torch.device("cuda:0"), torch.bfloat16) == want
    assert dot_precisions(torch.device("cuda:0"), torch.float32) == ("ieee", "ieee")


def test_flash_and_mla_launch_shapes_on_amd(rocm):
    from kdaserve.ops.kda.flash.config import DEFAULT_CONFIG, config_for
    from kdaserve.ops.kda.fused.decode import STREAM_BF16, STREAM_BF16_AMD, default_config
    from kdaserve.ops.mla.decode import dense_launch, launch_shape

    rocm("gfx942")
    cfg = config_for(torch.device("cuda:0"))
    assert (cfg.recur_stages, cfg.seg_warps) == (2, 8)               # 64 KB of LDS; the map pass spills at 4 warps
    assert launch_shape(precision.device_target(torch.device("cuda:0")), 512) == (16, 4, 2)
    assert launch_shape("sm_90", 512) == (32, 8, 3)
    assert dense_launch(precision.device_target(torch.device("cuda:0")), 512) == (16, 4, 2, 16)
    assert dense_launch("sm_90", 512) == (64, 4, 2, 32)      # Hopper's shared memory: 2 x 64-token tiles
    assert dense_launch("sm_89", 512) == (32, 8, 3, 16)
    precision._gpu_target.cache_clear()
    rocm("gfx950")
    cfg = config_for(torch.device("cuda:0"))
    assert cfg.recur_stages == DEFAULT_CONFIG.recur_stages and cfg.seg_warps == 8   # 160 KB: three stages fit
    assert default_config(128, 1, 4096, state_bytes=2, amd=True) == STREAM_BF16_AMD
    assert default_config(128, 1, 4096, state_bytes=2) == STREAM_BF16


@pytest.mark.parametrize("arch, with_aiter, prefill, decode", [
    ("gfx950", True, "aiter", "aiter"),      # AITER's KDA kernels where they exist
    ("gfx950", False, "flash", "fused"),     # else ours
    ("gfx942", True, "flash", "fused"),      # AITER's KDA kernels are gfx950-only
    ("gfx90a", False, "flash", "fused"),
])
def test_auto_on_rocm(arch, with_aiter, prefill, decode):
    modules = {"triton": "3.6.0", **OURS}
    if with_aiter:
        modules.update({"aiter": "0.1.9", "aiter.ops.triton.attention.kda": "", "aiter.ops.triton.attention.chunk_kda": ""})
    m = Machine("rocm", rocm_arch=arch, modules=modules)
    assert choose_auto("prefill", LayerSettings(), m)[0] == prefill
    assert choose_auto("decode", LayerSettings(), m)[0] == decode


def test_aiter_on_the_wrong_machine_lists_every_unmet_requirement():
    m = Machine("rocm", rocm_arch="gfx942", modules={"triton": "3.6.0", **OURS})
    with pytest.raises(BackendUnavailableError) as err:
        resolve_backend("prefill", "aiter", LayerSettings(head_dim=64, lower_bound=None), m)
    msg = str(err.value)
    for needle in ("gfx950", "this GPU is gfx942", "package `aiter`", "head size 128", "bounded"):
        assert needle in msg, (needle, msg)
