"""The shared Triton math (kdaserve/ops/triton_math.py) against fp64, element by element."""

import pytest
import torch
import triton
import triton.language as tl

from kdaserve.ops.triton_math import l2_normalize, log1p, log_decay, softplus

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _elementwise_kernel(x_ptr, y_ptr, a, lower_bound, n, WHAT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if WHAT == 0:
        y = log1p(x)
    elif WHAT == 1:
        y = softplus(x)
    elif WHAT == 2:
        y = log_decay(x, a, lower_bound, False)
    else:
        y = log_decay(x, a, lower_bound, True)
    tl.store(y_ptr + offs, y, mask=m)


def _run(x: torch.Tensor, what: int, a: float = 1.0, lower_bound: float = -5.0) -> torch.Tensor:
    y = torch.full_like(x, float("nan"))
    _elementwise_kernel[(triton.cdiv(x.numel(), 256),)](x, y, a, lower_bound, x.numel(), WHAT=what, BLOCK=256)
    return y


def _assert_fp32_accurate(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """Relative error per element within a few ulps plus what exp's argument costs: a GPU's fp32
    exp is ex2.approx(x * log2(e)), and rounding that product to fp32 moves e^x by up to
    |x| * 2^-24 relatively (1e-5 at |x| = 80). A lost cancellation (a plain log(1 + e^x)) errs by
    1% at x = -12 and 100% below x ~ -17, far outside this."""
    allowed = 2.0**-20 + x.double().abs() * 2.0**-23
    err = (y.double() - ref).abs() / ref.abs().clamp_min(1e-300)
    worst = int(torch.argmax(err / allowed))
    assert bool((err <= allowed).all()), (f"relative error {float(err[worst]):.3e} at x = {float(x[worst])} "
                                          f"(allowed {float(allowed[worst]):.3e})")


def test_log1p_is_accurate_for_tiny_and_ordinary_arguments():
    x = torch.cat([torch.logspace(-30, 0, 500), -torch.logspace(-30, -0.5, 500), torch.linspace(0.5, 100, 100)])
    x = x.float().to(DEV)
    ref = torch.log1p(x.double())
    _assert_fp32_accurate(_run(x, 0), ref, torch.zeros_like(x))


def test_softplus_keeps_relative_accuracy_where_it_is_tiny():
    # Where softplus(x) ~ e^x << 1 a plain log(1 + exp(x)) keeps only ~1e-7 / e^x of its digits
    # (1% at x = -12); the unbounded gate multiplies that by exp(A_log).
    x = torch.cat([torch.linspace(-80, 40, 2000), torch.tensor([-12.0, -20.0, 19.99, 20.0, 20.01])]).float().to(DEV)
    ref = torch.nn.functional.softplus(x.double(), threshold=20.0)
    _assert_fp32_accurate(_run(x, 1), ref, x)


@pytest.mark.parametrize("a", [1.0, 16.0])
def test_unbounded_gate_matches_fp64_to_fp32_accuracy(a):
    x = torch.linspace(-40, 30, 3000).float().to(DEV)
    ref = -a * torch.nn.functional.softplus(x.double(), threshold=20.0)
    _assert_fp32_accurate(_run(x, 2, a=a), ref, x)


def test_bounded_gate_matches_fp64_and_stays_in_range():
    x = torch.linspace(-30, 30, 3000).float().to(DEV)
    y = _run(x, 3, a=2.0, lower_bound=-5.0)
    ref = -5.0 * torch.sigmoid(2.0 * x.double())
    _assert_fp32_accurate(y, ref, 2.0 * x)
    assert bool(((y <= 0) & (y >= -5.0)).all())


@triton.jit
def _l2_kernel(x_ptr, y_ptr, scale, K: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, K))
    tl.store(y_ptr + tl.arange(0, K), l2_normalize(x, scale))


def test_l2_normalize_has_eps_inside_the_square_root():
    for x in (torch.randn(32), torch.full((32,), 1e-5)):
        x = x.float().to(DEV)
        y = torch.full_like(x, float("nan"))
        _l2_kernel[(1,)](x, y, 0.5, K=32)
        ref = x.double() / torch.sqrt((x.double() ** 2).sum() + 1e-6) * 0.5
        _assert_fp32_accurate(y, ref, 2.0 * x)
