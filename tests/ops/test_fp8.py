"""Block-scaled FP8 kernels (kdaserve/ops/fp8, the FP8 path of ops/moe/fused.py) against their torch
definitions (ops/fp8/reference.py): the activation quantizer's codes and scales, the linear GEMM and
the grouped expert GEMMs, on shapes with partial row, column and K blocks and decode-sized batches.
CPU: the interpreter; GPU: bf16 activations at GLM-5.3-Flash's sizes (128 x 128 blocks)."""

from __future__ import annotations

import os

import pytest
import torch

from kdaserve.ops.fp8 import (
    FP8_MAX,
    block_fp8_linear_reference,
    dequantize_blocks,
    quantize_blocks,
    quantize_per_token_group_reference,
)
from kdaserve.ops.moe import RouterConfig, moe_experts_reference, route_tokens
from kdaserve.ops.moe.reference import moe_experts_fp8_reference
from kdaserve.testing.compare import assert_rel_close, rel_rms

INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def fp8_weight(rows, cols, block, seed=0, device="cpu"):
    w = torch.randn(rows, cols, generator=_gen(seed)) * cols**-0.5
    q, s = quantize_blocks(w, block)
    return q.to(device), s.to(device)


def test_the_reference_round_trip_is_within_fp8_precision():
    w = torch.randn(40, 72, generator=_gen(0))
    q, s = quantize_blocks(w, (16, 32))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3)
    assert q.float().abs().max() <= FP8_MAX
    assert rel_rms(dequantize_blocks(q, s, (16, 32)), w) < 0.04          # e4m3: 3 mantissa bits
    blocks = dequantize_blocks(q, s, (16, 32))[:16, :32]
    assert abs(blocks.abs().max() / s[0, 0] - FP8_MAX) < 1e-3             # each block's max maps to 448


@INTERP
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_quantizer_matches_the_reference_codes_and_scales(dtype):
    from kdaserve.ops.fp8.quant import quantize_per_token_group

    x = (torch.randn(7, 80, generator=_gen(1)) * 30).to(dtype)   # 80 = 2 full groups of 32 + a partial one
    x[3] = 0                                                   # an all-zero row keeps a finite scale
    x[5, :32] *= 1e-3                                          # groups of very different size
    q, s = quantize_per_token_group(x, 32)
    q_ref, s_ref = quantize_per_token_group_reference(x, 32)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.isfinite(s).all() and (q[3].float() == 0).all()


@INTERP
@pytest.mark.parametrize("M, N, K, block", [(5, 40, 72, (16, 32)), (1, 48, 64, (16, 16)), (33, 24, 32, (8, 16))])
@pytest.mark.parametrize("bias", [False, True])
def test_the_linear_gemm_matches_the_reference(M, N, K, block, bias):
    from kdaserve.ops.fp8.block_gemm import block_fp8_linear

    w, s = fp8_weight(N, K, block, seed=2)
    x = torch.randn(M, K, generator=_gen(3))
    b = torch.randn(N, generator=_gen(4)) if bias else None
    got = block_fp8_linear(x, w, s, block, b)
    want = block_fp8_linear_reference(x, w, s, block, b)
    assert_rel_close(got, want, 1e-5, f"block FP8 linear {M}x{N}x{K}")
    dense = x @ dequantize_blocks(w, s, block).T + (b if bias else 0)   # what FP8 activations cost
    assert rel_rms(got, dense) < 0.05


@INTERP
def test_the_linear_gemm_keeps_leading_dims_and_takes_strided_rows():
    from kdaserve.ops.fp8.block_gemm import block_fp8_linear

    w, s = fp8_weight(32, 64, (16, 32), seed=5)
    x = torch.randn(2, 3, 96, generator=_gen(6))[..., 16:80]    # rows strided (a view of a wider tensor)
    got = block_fp8_linear(x, w, s, (16, 32))
    assert got.shape == (2, 3, 32)
    assert_rel_close(got.reshape(6, 32), block_fp8_linear_reference(x.reshape(6, 64), w, s, (16, 32)), 1e-5, "strided")


@pytest.mark.gpu
def test_gpu_gemm_refuses_column_blocks_below_32():
    from kdaserve.ops.fp8.block_gemm import block_fp8_linear

    w, s = fp8_weight(32, 64, (16, 16), device="cuda")
    with pytest.raises(ValueError, match="at least 32"):
        block_fp8_linear(torch.randn(4, 64, device="cuda"), w, s, (16, 16))


def test_the_gemm_refuses_wrong_scales_and_dtypes():
    from kdaserve.ops.fp8.block_gemm import block_fp8_gemm

    w, s = fp8_weight(32, 64, (16, 32))
    xq, xs = quantize_per_token_group_reference(torch.randn(4, 64), 32)
    with pytest.raises(ValueError, match=r"weight \[2, 2\]; got \[4, 2\] and \[1, 2\]"):
        block_fp8_gemm(xq, xs, w, s[:1], (16, 32), torch.float32)
    with pytest.raises(ValueError, match="FP8 weight"):
        block_fp8_gemm(xq, xs, w.float(), s, (16, 32), torch.float32)


def _routing(T, E, k, seed=0):
    g = _gen(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return torch.rand(T, k, generator=g) + 0.1, ids


def fp8_experts(E, hidden, inter, block, seed=0, device="cpu"):
    g = _gen(seed)
    w13 = torch.randn(E, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(E, hidden, inter, generator=g) * inter**-0.5
    (q13, s13), (q2, s2) = quantize_blocks(w13, block), quantize_blocks(w2, block)
    return [t.to(device) for t in (q13, s13, q2, s2)]


@INTERP
@pytest.mark.parametrize("T, E, k, limit", [(13, 8, 3, None), (1, 6, 2, 0.5), (20, 4, 4, None)])
def test_fp8_experts_match_the_reference(T, E, k, limit):
    from kdaserve.ops.moe.fused import moe_experts_fused

    block = (16, 32)
    w13, s13, w2, s2 = fp8_experts(E, 80, 48, block)     # hidden 80: a partial K block; width 48: 3 row blocks
    x = torch.randn(T, 80, generator=_gen(7)) * 3
    weights, ids = _routing(T, E, k)
    got = moe_experts_fused(x, w13, w2, weights, ids, limit, w13_scale=s13, w2_scale=s2, block=block)
    want = moe_experts_fp8_reference(x, w13, w2, weights, ids, limit, s13, s2, block)
    assert_rel_close(got, want, 1e-5, f"FP8 experts T={T}")
    dense = moe_experts_reference(x, dequantize_blocks(w13, s13, block), dequantize_blocks(w2, s2, block),
                                  weights, ids, limit)
    assert rel_rms(got, dense) < 0.1    # two activation roundings to 3 mantissa bits; a wrong scale is O(1)


def test_fp8_experts_refuse_missing_or_misshapen_scales():
    from kdaserve.ops.moe.fused import moe_experts_fused

    w13, s13, w2, s2 = fp8_experts(4, 32, 32, (16, 16))
    weights, ids = _routing(3, 4, 2)
    with pytest.raises(ValueError, match="need w13 and w2 in float8_e4m3fn with w13_scale"):
        moe_experts_fused(torch.randn(3, 32), w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"must be w13 \[4, 4, 2\] and w2 \[4, 2, 2\]; got \[4, 4, 1\]"):
        moe_experts_fused(torch.randn(3, 32), w13, w2, weights, ids, w13_scale=s13[..., :1], w2_scale=s2, block=(16, 16))


# ---- GPU: bf16 activations, GLM-5.3-Flash's sizes ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64, 4096])
@pytest.mark.parametrize("N, K", [(4096, 4096), (12288, 4096), (4096, 2048)])
def test_gpu_linear_gemm_at_glm_sizes(M, N, K):
    from kdaserve.ops.fp8.block_gemm import block_fp8_linear

    block = (128, 128)
    w, s = fp8_weight(N, K, block, seed=8, device="cuda")
    x = torch.randn(M, K, generator=_gen(9)).cuda().bfloat16()
    out = block_fp8_linear(x, w, s, block)
    want = block_fp8_linear_reference(x.float(), w, s, block)
    assert_rel_close(out.float(), want, 5e-3, f"block FP8 linear bf16 {M}x{N}x{K}")


@pytest.mark.gpu
def test_gpu_quantizer_codes_match_torch():
    from kdaserve.ops.fp8.quant import quantize_per_token_group

    x = torch.randn(256, 4096, generator=_gen(10)).cuda().bfloat16() * 7
    q, s = quantize_per_token_group(x, 128)
    q_ref, s_ref = quantize_per_token_group_reference(x.float(), 128)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # The kernel's division may differ from torch's by an ulp, which moves a value sitting on a
    # rounding boundary by one code: allow a few in a million.
    assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_gpu_fp8_experts_at_glm_sizes(T):
    from kdaserve.ops.moe.fused import moe_experts_fused

    E, k, hidden, inter, block = 64, 8, 4096, 2048, (128, 128)   # 64 of GLM's 288 experts (memory)
    w13, s13, w2, s2 = fp8_experts(E, hidden, inter, block, seed=11, device="cuda")
    x = torch.randn(T, hidden, generator=_gen(12)).cuda().bfloat16()
    gate = torch.randn(E, hidden, generator=_gen(13)).cuda() * hidden**-0.5
    weights, ids = route_tokens(x, gate, None, RouterConfig(E, k, routed_scaling_factor=2.5))
    got = moe_experts_fused(x, w13, w2, weights, ids, 10.0, w13_scale=s13, w2_scale=s2, block=block)
    # The definition in bf16: the SiLU product is rounded to bf16 before it is quantized, as the
    # kernel stores it (in fp32 the FP8 codes move and the results differ by ~1%). Even so a product
    # on a rounding boundary flips a code (6%) now and then: 5e-7 at 64 tokens, 5e-3 at 2048 (H200).
    want = moe_experts_fp8_reference(x, w13, w2, weights, ids, 10.0, s13, s2, block)
    assert_rel_close(got.float(), want.float(), 1e-2, f"FP8 experts bf16 T={T}")


def test_fp8_kernels_refuse_inputs_they_cannot_take_and_say_what_would_do():
    from kdaserve.ops.fp8.block_gemm import block_fp8_gemm
    from kdaserve.ops.fp8.quant import quantize_per_token_group
    from kdaserve.ops.moe.fused import moe_experts_fused

    with pytest.raises(ValueError, match="group must be a power of two >= 16, got 24"):
        quantize_per_token_group(torch.randn(2, 48), 24)
    with pytest.raises(ValueError, match=r"\[T, K\] tensor with contiguous rows"):
        quantize_per_token_group(torch.randn(48, 2).T, 16)
    w, s = fp8_weight(32, 64, (16, 32))
    xq, xs = quantize_per_token_group_reference(torch.randn(4, 64), 32)
    with pytest.raises(ValueError, match="both scales with contiguous rows"):
        block_fp8_gemm(xq, xs, w, s.T.contiguous().T, (16, 32), torch.float32)
    w13, s13, w2, s2 = fp8_experts(4, 32, 24, (16, 16))     # width 24: the gate and up halves would share a block
    weights, ids = _routing(3, 4, 2)
    with pytest.raises(ValueError, match=r"expert width \(24\) to be a multiple of the block's 16 rows"):
        moe_experts_fused(torch.randn(3, 32), w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, block=(16, 16))
    from kdaserve.ops.moe.fused import MoeTiles

    w13, s13, w2, s2 = fp8_experts(4, 32, 32, (16, 16))
    tiles = MoeTiles(16, (16, 32, 4, None), (16, 16, 4, None))   # gate_up would step K by 32, across two scale blocks
    with pytest.raises(ValueError, match="FP8 experts step K by the scale block's 16 columns; tiles asked 32 and 16"):
        moe_experts_fused(torch.randn(3, 32), w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, block=(16, 16),
                          tiles=tiles)
