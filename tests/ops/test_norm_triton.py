"""Triton gated RMSNorm against the torch reference (interpreter on CPU, bf16 on the GPU)."""

import pytest
import torch

from kdaserve.ops.kda.reference import gated_rms_norm
from kdaserve.ops.norm import gated_rms_norm_fwd
from kdaserve.testing import assert_rel_close, nan_poison, tolerance_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T, H, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = (torch.randn(T, H, D, generator=g) * 3).to(dtype).to(DEV)
    output_gate_logits = torch.randn(T, H, D, generator=g).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(DEV)
    return o, output_gate_logits, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [16, 32])
def test_matches_reference(dtype, D):
    o, output_gate_logits, w = _inputs(7, 3, D, dtype)
    out = nan_poison(torch.empty(7, 3, D, dtype=dtype, device=DEV))
    gated_rms_norm_fwd(o, output_gate_logits, w, 1e-5, out)
    assert_rel_close(out, gated_rms_norm(o.double(), output_gate_logits.double(), w).to(dtype), tolerance_for(dtype),
                     "gated norm")


def test_fp32_output_from_fp16_input_keeps_fp32_math():
    o, output_gate_logits, w = _inputs(5, 2, 16, torch.float16, seed=1)
    out = nan_poison(torch.empty(5, 2, 16, device=DEV))
    gated_rms_norm_fwd(o, output_gate_logits, w, 1e-5, out)
    assert_rel_close(out, gated_rms_norm(o.double(), output_gate_logits.double(), w), 1e-6, "fp32 out")


def test_strided_gate_and_flat_layouts_equal_contiguous_bit_for_bit():
    T, H, D = 6, 2, 16
    o, output_gate_logits, w = _inputs(T, H, D, torch.float32, seed=2)
    buf = torch.randn(T, H * D + 5, device=DEV)
    g_view = buf[:, 3 : 3 + H * D]  # [T, P] column slice, like a projection output
    out_a = nan_poison(torch.empty(T, H, D, device=DEV))
    out_b = nan_poison(torch.empty(T, H * D, device=DEV))
    gated_rms_norm_fwd(o, g_view, w, 1e-5, out_a)
    gated_rms_norm_fwd(o, g_view.contiguous().view(T, H, D), w, 1e-5, out_b)
    assert torch.equal(out_a.view(T, H * D), out_b)


def test_rows_with_null_index_are_not_written():
    T, H, D = 6, 2, 16
    o, output_gate_logits, w = _inputs(T, H, D, torch.float32, seed=3)
    idx = torch.tensor([3, 0, 5, -1, 2, 7], dtype=torch.int32, device=DEV)
    out = nan_poison(torch.empty(T, H, D, device=DEV))
    gated_rms_norm_fwd(o, output_gate_logits, w, 1e-5, out, row_state_indices=idx)
    keep = idx > 0
    assert torch.isnan(out[~keep]).all()
    assert_rel_close(out[keep], gated_rms_norm(o, output_gate_logits, w)[keep], 1e-5, "valid rows")


def test_tokens_per_index_with_strided_index_column():
    """Speculative rows: S+1 tokens share the index spec[:, 0] (a strided column, no copy)."""
    N, m, H, D = 3, 3, 2, 16
    o, output_gate_logits, w = _inputs(N * m, H, D, torch.float32, seed=4)
    spec = torch.tensor([[4, 5, 6], [0, 1, 2], [7, 8, 9]], dtype=torch.int32, device=DEV)
    out = nan_poison(torch.empty(N * m, H, D, device=DEV))
    gated_rms_norm_fwd(o, output_gate_logits, w, 1e-5, out, row_state_indices=spec[:, 0], tokens_per_index=m)
    keep = (spec[:, :1] > 0).expand(N, m).reshape(-1)
    assert torch.isnan(out[~keep]).all()
    assert_rel_close(out[keep], gated_rms_norm(o, output_gate_logits, w)[keep], 1e-5, "valid rows")


def test_rejects_bad_shapes():
    o, output_gate_logits, w = _inputs(4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="output_gate_logits must be"):
        gated_rms_norm_fwd(o, output_gate_logits[:, :1], w, 1e-5, torch.empty_like(o))
    with pytest.raises(ValueError, match="weight must be"):
        gated_rms_norm_fwd(o, output_gate_logits, w[:8], 1e-5, torch.empty_like(o))


@pytest.mark.gpu
def test_gpu_bf16_real_shape():
    o, output_gate_logits, w = _inputs(4096, 32, 128, torch.bfloat16, seed=5)
    out = nan_poison(torch.empty_like(o))
    gated_rms_norm_fwd(o, output_gate_logits, w, 1e-5, out)
    assert_rel_close(out, gated_rms_norm(o.double(), output_gate_logits.double(), w).to(torch.bfloat16),
                     tolerance_for(torch.bfloat16), "gated norm")
