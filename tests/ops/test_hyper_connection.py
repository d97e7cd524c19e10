"""The mHC Triton kernels (ops/hyper_connection/triton_hc.py) against the torch reference on fresh
random inputs (interpreter on the CPU, fp32 and fp16, a D that is not a power of two, one token and
several), and compiled for sm_90 without a GPU."""

from __future__ import annotations

import pytest
import torch

from kdaserve.ops.hyper_connection.reference import hc_post_reference, hc_pre_reference
from kdaserve.ops.hyper_connection.triton_hc import hc_post_triton, hc_pre_triton

pytestmark = pytest.mark.usefixtures("interpret")


@pytest.fixture
def interpret():
    import triton

    if not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")


def _weights(N: int, D: int, g: torch.Generator):
    width = (2 + N) * N
    fn = torch.randn(width, N * D, generator=g) * (N * D) ** -0.5
    return fn, torch.randn(width, generator=g) * 0.5, 1 + 0.3 * torch.randn(3, generator=g)


@pytest.mark.parametrize("T, D, dtype", [(1, 64, torch.float32), (5, 100, torch.float32), (3, 96, torch.float16)])
def test_hc_pre_and_post_match_the_reference(T, D, dtype):
    g = torch.Generator().manual_seed(T * 1000 + D)
    N = 4
    device = "cuda" if torch.cuda.is_available() else "cpu"
    streams = torch.randn(T, N, D, generator=g).to(dtype).to(device)
    fn, base, scale = (t.to(device) for t in _weights(N, D, g))
    kw = dict(iters=20, hc_eps=1e-6, norm_eps=1e-5)
    post, comb, x = hc_pre_triton(streams, fn, base, scale, **kw)
    post_r, comb_r, x_r = hc_pre_reference(streams, fn, base, scale, **kw)
    torch.testing.assert_close(post, post_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_r, rtol=1e-5, atol=1e-6)
    assert torch.allclose(comb.sum(-1), torch.ones(T, N, device=device), atol=1e-3)   # doubly stochastic
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(x.float(), x_r.float(), **tol)
    out = torch.randn(T, D, generator=g).to(dtype).to(device)
    y = hc_post_triton(streams, out, post_r, comb_r)
    y_r = hc_post_reference(streams.float(), out.float(), post_r, comb_r)   # fp32: the kernel does not round comb
    assert y.dtype == dtype and y.shape == streams.shape
    torch.testing.assert_close(y.float(), y_r, **tol)


def test_a_stream_count_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power-of-two number of streams"):
        hc_post_triton(torch.zeros(1, 3, 8), torch.zeros(1, 8), torch.zeros(1, 3), torch.zeros(1, 3, 3))


_SM90 = '''
import re
from kdaserve.ops.hyper_connection.triton_hc import hc_post_kernel, hc_pre_kernel
from tools.sm90_compile import compile_for_sm90, ptxas_report
pre = compile_for_sm90(hc_pre_kernel, dict(s_ptr="*bf16", raw_ptr="*fp32", base_ptr="*fp32", scale_ptr="*fp32",
                       post_ptr="*fp32", comb_ptr="*fp32", x_ptr="*bf16", D="i32", hc_eps="fp32", norm_eps="fp32"),
                       dict(N=4, ITERS=20, BD=1024))
post = compile_for_sm90(hc_post_kernel, dict(s_ptr="*bf16", out_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32",
                        y_ptr="*bf16", D="i32"), dict(N=4, BD=256))
for k in (pre, post):
    r = ptxas_report(k)
    assert re.match(r"regs=\\d+ spill_st=0 ", r), r
    print(r)
print("ok")
'''


def test_both_kernels_compile_for_sm90(tmp_path):
    """ptxas without spills at GLM's shape (4 streams; D is a runtime argument)."""
    from compiled_mode import run_compiled

    script = tmp_path / "hc_sm90.py"
    script.write_text(_SM90)
    print(run_compiled([str(script)], timeout=300))
