"""The LM head's fp32 logits on CUDA (a GEMM that writes fp32) against fp32 math on the same weights."""

import pytest
import torch

from kdaserve.layers.embed_head import LMHead

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2304), (64, 2304), (3, 5, 512), (0, 512)])
def test_logits_fp32_from_one_gemm(dtype, shape):
    torch.manual_seed(0)
    head = LMHead(4099, shape[-1], dtype=dtype, device="cuda")
    head.weight.data.normal_(0, 0.02)
    hidden = torch.randn(*shape, dtype=dtype, device="cuda")
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (*shape[:-1], 4099)
    exact = hidden.float() @ head.weight.float().t()
    if not exact.numel():   # an empty batch: the shape only
        return
    # fp32 output: error is accumulation order only, well below one 2-byte rounding of the logits
    rounding = (exact.to(dtype).float() - exact).abs().max()
    assert (logits - exact).abs().max() < rounding / 4


def test_logits_in_a_cuda_graph():
    torch.manual_seed(0)
    head = LMHead(1000, 256, dtype=torch.bfloat16, device="cuda")
    head.weight.data.normal_(0, 0.02)
    hidden = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda")
    head(hidden)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head(hidden)
    hidden.copy_(torch.randn_like(hidden))
    graph.replay()
    torch.testing.assert_close(out, head(hidden), rtol=0, atol=0)
