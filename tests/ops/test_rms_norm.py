"""The fused residual-add + RMSNorm kernel (ops/norm/rms_norm.py) against layers/norm.RMSNorm's
torch path, its definition: fresh random inputs, odd widths, strided rows, both with and without
the residual; the new residual stream bit for bit (one fp32 add, one rounding), and the norm of
the rounded stream (fp16 within 1e-4: normalizing the unrounded sum is off by 3.5e-4)."""

from __future__ import annotations

import os

import pytest
import torch

from kdaserve.layers.norm import RMSNorm
from kdaserve.testing.compare import assert_rel_close

INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")


def _reference(D: int, dtype, device, seed: int) -> RMSNorm:
    norm = RMSNorm(D, 1e-6, dtype=dtype, device=device, backend="reference")
    norm.weight.copy_(torch.randn(D, generator=torch.Generator().manual_seed(seed)).to(device) * 0.5 + 1)
    return norm


def _check(x: torch.Tensor, residual: torch.Tensor | None, tol: float) -> None:
    from kdaserve.ops.norm.rms_norm import rms_norm_fwd

    ref = _reference(x.shape[-1], x.dtype, x.device, seed=x.numel())
    got, want = rms_norm_fwd(x, ref.weight, ref.eps, residual), ref(x, residual)
    if residual is None:
        assert_rel_close(got.float(), want.float(), tol, "RMSNorm")
        return
    assert_rel_close(got[0].float(), want[0].float(), tol, "RMSNorm of x + residual")
    assert torch.equal(got[1], want[1]), "the new residual stream differs from the torch path's"
    assert got[1].dtype == x.dtype


@INTERP
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 1e-4)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(37, 48), (1, 16), (3, 5, 64), (2, 2304)], ids=["odd-width", "one-row", "3d", "kimi"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_kernel_matches_the_torch_path(dtype, tol, shape, with_residual):
    g = torch.Generator().manual_seed(hash((shape, with_residual)) % 2**31)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    residual = (torch.randn(shape, generator=g) * 3).to(dtype) if with_residual else None
    _check(x, residual, tol)


@INTERP
def test_strided_rows_and_an_fp32_residual():
    """A column slice of a wider projection (rows strided), and a residual stream in fp32 while x is
    fp16: the new stream takes x's dtype, as the torch path rounds it."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(9, 80, generator=g).half()
    x = wide[:, 8:56]
    residual = torch.randn(9, 48, generator=g)
    _check(x, residual, 1e-4)
    _check(x, None, 1e-4)


def test_bad_inputs_say_what_is_needed():
    from kdaserve.ops.norm.rms_norm import rms_norm_fwd

    with pytest.raises(ValueError, match=r"weight must be \[16\] for inputs \[\.\.\., 16\], got \(8,\)"):
        rms_norm_fwd(torch.randn(2, 16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"residual must have the input's shape \(2, 16\), got \(2, 8\)"):
        rms_norm_fwd(torch.randn(2, 16), torch.ones(16), 1e-6, torch.randn(2, 8))
    with pytest.raises(ValueError, match="unknown RMSNorm backend 'cuda'"):
        RMSNorm(16, backend="cuda")


def test_an_explicit_triton_backend_on_the_cpu_says_what_is_missing(monkeypatch):
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)   # a CPU without the interpreter
    with pytest.raises(ValueError, match="RMSNorm backend 'triton' cannot run here"):
        RMSNorm(16, device="cpu", backend="triton")


def test_auto_takes_the_torch_path_on_the_cpu():
    norm = RMSNorm(16)
    x = torch.randn(3, 16)
    assert torch.equal(norm(x), norm._norm(x))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 8192])
def test_gpu_bf16_at_kimi_linear_width(T):
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, 2304, device="cuda", generator=g).bfloat16()
    residual = torch.randn(T, 2304, device="cuda", generator=g).bfloat16()
    _check(x, residual, 2e-3)   # the reduction's order may flip a rare bf16 rounding
    _check(x, None, 2e-3)
    norm = RMSNorm(2304, dtype=torch.bfloat16, device="cuda")   # auto takes the kernel on a GPU
    y, r = norm(x, residual)
    assert torch.equal(r, (x.float() + residual.float()).bfloat16())
