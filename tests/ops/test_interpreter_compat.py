"""ops/interpreter_compat.py: Triton's interpreter computing bf16 as the GPU does (CPU only: the
interpreter held bf16 as uint16 bits and applied integer arithmetic to them)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat

INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")


@triton.jit
def _bf16_ops_kernel(a_ptr, b_ptr, c_ptr, prod_ptr, sum_ptr, fma_ptr, max_ptr, less_ptr, dot_ptr, scaled_ptr):
    i = tl.arange(0, 16)
    a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
    b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
    c = tl.load(c_ptr + i[:, None] * 16 + i[None, :])
    at = i[:, None] * 16 + i[None, :]
    tl.store(prod_ptr + at, a * b)
    tl.store(sum_ptr + at, a - b)
    tl.store(fma_ptr + at, tl.fma(a, b, c))
    tl.store(max_ptr + at, tl.maximum(a, b))
    tl.store(less_ptr + at, (a < b).to(tl.int32))
    tl.store(dot_ptr + at, tl.dot(a, b))
    tl.store(scaled_ptr + at, a * 0.1875)   # a bf16 scalar constant


@INTERP
def test_bf16_arithmetic_comparisons_and_dots_in_the_interpreter_follow_torch():
    """Each result rounded once from the exact fp32 value (torch's bf16 ops do the same on the CPU)."""
    interpreter_compat.install()
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(16, 16, generator=g).bfloat16() for _ in range(3))
    outs = [torch.full((16, 16), float("nan")).bfloat16() for _ in range(4)]
    less = torch.full((16, 16), -1, dtype=torch.int32)
    dot = torch.full((16, 16), float("nan"))
    scaled = torch.full((16, 16), float("nan")).bfloat16()
    _bf16_ops_kernel[(1,)](a, b, c, *outs, less, dot, scaled)
    prod, diff, fma, mx = outs
    assert torch.equal(prod, a * b) and torch.equal(diff, a - b) and torch.equal(mx, torch.maximum(a, b))
    assert torch.equal(fma, torch.addcmul(c.float(), a.float(), b.float()).bfloat16())
    assert torch.equal(less.bool(), a < b)
    assert torch.allclose(dot, a.float() @ b.float(), rtol=1e-6, atol=1e-5)
    assert torch.equal(scaled, a * 0.1875)
