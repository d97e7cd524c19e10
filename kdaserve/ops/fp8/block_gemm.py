"""The block-scaled FP8 linear layer (Triton): y = x W^T with W in FP8 blocks and x quantized per
token and K group on the fly (quant.py); each K block is one FP8 tensor-core dot whose fp32 result
is scaled by the rows' activation scales and the columns' weight scales before it is accumulated.

One program per (BM rows, BN output columns) tile; BK = the weight's column block, so a program
reads one activation scale per row and one weight scale per column for each K step. Tiles by batch
size (GEMM_CONFIGS): small BM for decode-sized batches (the weight is read once per BM rows: the
cost there is its bytes), large tiles for prefill (tensor throughput)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.fp8.quant import quantize_per_token_group
from kdaserve.ops.fp8.reference import FP8


@triton.jit
def _block_fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr,
    M, N, K, stride_a, stride_as, stride_w, stride_ws, stride_c,
    BLOCK_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    # Rows and columns past the edge wrap around instead of being masked: the loads stay unmasked
    # (fewer predicate registers, straight pipelining) and the store drops them.
    rows_in = (rows % M).to(tl.int64)
    cols_in = (cols % N).to(tl.int64)
    ks = tl.arange(0, BK)
    a_tile = a_ptr + rows_in[:, None] * stride_a + ks[None, :]
    w_tile = w_ptr + cols_in[None, :] * stride_w + ks[:, None]
    a_scales = as_ptr + rows_in * stride_as
    w_scales = ws_ptr + (cols_in // BLOCK_ROWS) * stride_ws
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_tile)
            w = tl.load(w_tile)
        else:
            k_ok = kb * BK + ks < K
            a = tl.load(a_tile, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_tile, mask=k_ok[:, None], other=0.0)
        sa = tl.load(a_scales + kb)
        sw = tl.load(w_scales + kb)
        acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
        a_tile += BK
        w_tile += BK
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
    out = c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols.to(tl.int64)[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


# (BM, BN, warps, stages) by batch size, chosen by the H200 sweep of `benchmarks/bench_fp8_gemm.py
# --sweep` over GLM-5.3-Flash's linear shapes (docs/perf-notes.md): one token, up to 64, prefill.
# Each is spill-free on every target (tools/compile_check).
GEMM_CONFIGS = {16: (16, 64, 4, 6), 32: (32, 64, 4, 4), 64: (64, 64, 4, 3), None: (64, 128, 4, 3)}


def gemm_config(M: int) -> tuple[int, int, int, int]:
    for bound, config in GEMM_CONFIGS.items():
        if bound is not None and M <= bound:
            return config
    return GEMM_CONFIGS[None]


def min_column_block(device: torch.device) -> int:
    """FP8 tensor-core dots take K >= 32 (the interpreter takes 16)."""
    return 32 if device.type == "cuda" else 16


def block_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                   config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """xq [M, K] FP8 with x_scale [M, ceil(K / bc)], weight [N, K] FP8 with scale_inv
    [ceil(N / br), ceil(K / bc)] -> [M, N] in out_dtype. `config`: (BM, BN, warps, stages) instead
    of GEMM_CONFIGS' (benchmark sweeps)."""
    M, K = xq.shape
    N = weight.shape[0]
    br, bc = block
    if weight.dtype != FP8 or xq.dtype != FP8 or weight.shape[1] != K:
        raise ValueError(f"block FP8 GEMM takes FP8 x [M, K] and FP8 weight [N, K]; got x {tuple(xq.shape)} "
                         f"{xq.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    if tuple(x_scale.shape) != (M, triton.cdiv(K, bc)) or tuple(scale_inv.shape) != (triton.cdiv(N, br), triton.cdiv(K, bc)):
        raise ValueError(f"scales for {br} x {bc} blocks must be x [{M}, {triton.cdiv(K, bc)}] and weight "
                         f"[{triton.cdiv(N, br)}, {triton.cdiv(K, bc)}]; got {list(x_scale.shape)} and {list(scale_inv.shape)}")
    if bc < min_column_block(xq.device) or bc & (bc - 1):
        raise ValueError(f"the weight's column block (one K step) must be a power of two of at least "
                         f"{min_column_block(xq.device)} on {xq.device.type}, got {bc}")
    if xq.stride(1) != 1 or weight.stride(1) != 1 or x_scale.stride(1) != 1 or scale_inv.stride(1) != 1:
        raise ValueError("block FP8 GEMM needs x, the weight and both scales with contiguous rows")
    interpreter_compat.install()
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    BM, BN, warps, stages = config or gemm_config(M)
    _block_fp8_gemm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        xq, x_scale, weight, scale_inv, bias if bias is not None else out, out,
        M, N, K, xq.stride(0), x_scale.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        BLOCK_ROWS=br, HAS_BIAS=bias is not None, EVEN_K=K % bc == 0, BM=BM, BN=BN, BK=bc,
        num_warps=warps, num_stages=stages,
    )
    return out


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] in bf16/fp16/fp32 -> x W^T (+ bias) [..., N] in x's dtype, W block-scaled FP8."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xq, xs = quantize_per_token_group(x2, block[1])
    return block_fp8_gemm(xq, xs, weight, scale_inv, block, x.dtype, bias, config).view(*lead, weight.shape[0])
