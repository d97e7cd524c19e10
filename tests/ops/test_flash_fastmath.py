"""kdaserve.ops.kda.flash.fastmath on the GPU: each single-MUFU function meets the error bound that
docs/flash-prefill.md's numerics rely on (the PTX forms exist only on NVIDIA; the interpreter runs
plain Triton math, so these tests need a GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from kdaserve.ops.kda.flash.fastmath import fast_exp, fast_rcp, fast_sigmoid, sigmoid_tanh

gpu = pytest.mark.skipif(bool(triton.knobs.runtime.interpret) or not torch.cuda.is_available(),
                         reason="needs a GPU without the interpreter")


@triton.jit
def _apply(x_ptr, o_ptr, n, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=1.0)
    if WHICH == 0:
        y = fast_exp(x, True)
    elif WHICH == 1:
        y = fast_rcp(x, True)
    elif WHICH == 2:
        y = fast_sigmoid(x, True)
    else:
        y = sigmoid_tanh(x, True)
    tl.store(o_ptr + i, y, mask=i < n)


def _run(which: int, x: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    _apply[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), WHICH=which, BLOCK=1024)
    return out.double()


@pytest.mark.gpu
@gpu
def test_exp_rcp_and_sigmoid_are_relatively_accurate():
    """fast_exp, fast_rcp and fast_sigmoid: relative error ~2^-22 wherever the result is a normal
    fp32 number (the decay gate's sigmoid relies on it for tiny values), plus the fp32 rounding
    of the exponent's argument x * log2(e): the product's half ulp (up to 2^-24 |x| log2(e)) and
    log2(e)'s own rounding to fp32 (~1.3e-8 |x|), times ln 2 in the result (~8e-8 |x| in all)."""
    x = torch.linspace(-80.0, 80.0, 200_001, device="cuda")
    xd = x.double()
    bound = 2e-6 + 8e-8 * xd.abs()

    def within(y, ref, b):
        return bool(((y - ref).abs() <= b * ref.abs()).all())

    assert within(_run(0, x), xd.exp(), bound)
    nz = x[x.abs() > 1e-3]
    assert within(_run(1, nz), 1.0 / nz.double(), 1e-6)
    assert within(_run(2, x), torch.sigmoid(xd), bound)  # down to sigmoid(-80) = 1.8e-35


@pytest.mark.gpu
@gpu
def test_sigmoid_tanh_error_is_small_and_absolute():
    """sigmoid_tanh: at most ~2.4e-4 absolute (tanh.approx's 2^-11), what the SiLU and output-gate
    uses need; it is not relatively accurate near 0, which is why the decay gate does not use it."""
    x = torch.linspace(-60.0, 60.0, 200_001, device="cuda")
    y, ref = _run(3, x), torch.sigmoid(x.double())
    assert (y - ref).abs().max().item() < 3e-4
