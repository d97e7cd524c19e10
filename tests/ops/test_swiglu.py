"""SwiGLU in one launch (ops/activation/swiglu.py) against layers/mlp.SwiGLUMLP's torch path, its
definition: fresh random inputs, odd widths, strided rows (a slice of a wider GEMM output), with
and without GLM-5.3-Flash's clamps; fp32 equal to 1e-6, fp16 within the torch path's extra
rounding (it rounds silu(gate) before the product)."""

from __future__ import annotations

import os

import pytest
import torch

from kdaserve.layers.mlp import SwiGLUMLP
from kdaserve.ops.activation.swiglu import swiglu_fwd, swiglu_reference
from kdaserve.testing.compare import assert_rel_close

INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")


@INTERP
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(37, 2 * 40), (1, 2 * 16), (3, 5, 2 * 64), (2, 2 * 1100)],
                         ids=["odd-width", "one-row", "3d", "wider-than-a-program"])
@pytest.mark.parametrize("limit", [None, 0.75], ids=["plain", "clamped"])
def test_kernel_matches_the_torch_path(dtype, tol, shape, limit):
    x = (torch.randn(shape) * 3).to(dtype)
    got = swiglu_fwd(x, limit)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    assert_rel_close(got.float(), swiglu_reference(x, limit).float(), tol, "SwiGLU")
    if limit is not None:   # the clamps took effect: the plain activation differs
        assert not torch.allclose(got.float(), swiglu_reference(x).float())


@INTERP
def test_strided_rows_of_a_wider_output():
    wide = torch.randn(9, 100)
    x = wide[:, 10:90]   # rows 100 apart, gate|up 40 + 40
    assert_rel_close(swiglu_fwd(x), swiglu_reference(x), 1e-6, "SwiGLU of strided rows")
    assert swiglu_fwd(wide[:0, :80]).shape == (0, 40)


@INTERP
def test_the_mlp_takes_the_kernel_when_asked(monkeypatch):
    import kdaserve.ops.activation.swiglu as swiglu

    mlp = SwiGLUMLP(24, 40, activation_limit=1.5, backend="triton")
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ref = SwiGLUMLP(24, 40, activation_limit=1.5, backend="reference")
    ref.load_state_dict(mlp.state_dict())
    calls = []
    monkeypatch.setattr(swiglu, "swiglu_fwd", lambda *a: calls.append(1) or swiglu_fwd(*a))
    x = torch.randn(7, 24)
    assert_rel_close(mlp(x), ref(x), 1e-6, "SwiGLU MLP")
    assert calls == [1]


def test_bad_inputs_say_what_is_needed():
    with pytest.raises(ValueError, match="merged gate\\|up rows of even width, got 7"):
        swiglu_fwd(torch.randn(2, 7))
    with pytest.raises(ValueError, match="unknown SwiGLU backend 'cuda'"):
        SwiGLUMLP(8, 8, backend="cuda")


def test_auto_takes_the_torch_path_on_the_cpu(monkeypatch):
    import kdaserve.ops.activation.swiglu as swiglu

    monkeypatch.setattr(swiglu, "swiglu_fwd", lambda *a: pytest.fail("the kernel ran on a CPU with backend auto"))
    mlp = SwiGLUMLP(8, 16)
    assert mlp(torch.randn(3, 8)).shape == (3, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 8192])
def test_gpu_bf16_at_kimi_linear_widths(T):
    for inter in (1024, 9216):   # the shared experts, the dense first layer
        x = torch.randn(T, 2 * inter, device="cuda").bfloat16()
        assert_rel_close(swiglu_fwd(x).float(), swiglu_reference(x).float(), 4e-3, f"SwiGLU I={inter}")
    mlp = SwiGLUMLP(2304, 1024, dtype=torch.bfloat16, device="cuda")   # auto takes the kernel on a GPU
    torch.nn.init.normal_(mlp.gate_up_proj.weight, std=0.02)
    torch.nn.init.normal_(mlp.down_proj.weight, std=0.02)
    h = torch.randn(T, 2304, device="cuda").bfloat16()
    want = mlp.down_proj(swiglu_reference(mlp.gate_up_proj(h)))
    assert_rel_close(mlp(h).float(), want.float(), 4e-3, "SwiGLU MLP")
