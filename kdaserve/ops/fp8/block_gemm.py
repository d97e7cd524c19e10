"""The block-scaled FP8 linear layer (Triton): y = x W^T with W in FP8 blocks and x quantized per
token and K group on the fly (quant.py); each K block is one FP8 tensor-core dot whose fp32 result
is scaled by the rows' activation scales and the columns' weight scales before it is accumulated.

One program per (BM rows, BN output columns) tile; BK = the weight's column block, so a program
reads one activation scale per row and one weight scale per column for each K step. Tiles: small
BM for decode-sized batches (the weight is read once per BM rows: the cost there is its bytes),
BN shrinks until the grid fills the card."""

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
    BLOCK_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
    cols64 = tl.where(col_ok, cols, 0).to(tl.int64)
    a_rows = a_ptr + rows64[:, None] * stride_a
    w_cols = w_ptr + cols64[None, :] * stride_w
    a_scales = as_ptr + rows64 * stride_as
    w_scales = ws_ptr + (cols64 // BLOCK_ROWS) * stride_ws
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        ks = kb * BK + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        sa = tl.load(a_scales + kb, mask=row_ok, other=0.0)
        sw = tl.load(w_scales + kb, mask=col_ok, other=0.0)
        acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols64, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows64[:, None] * stride_c + cols64[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def gemm_tiles(M: int, N: int, sms: int = 132) -> tuple[int, int]:
    """(BM, BN): BM follows the batch; BN the largest of 128/64/32 that still gives every SM a
    program (decode steps have few row tiles, so the columns must supply the parallelism). Past
    BM = 16, BN stops at 64: a [64, 128] program spills on sm_100 even at eight warps."""
    BM = 16 if M <= 16 else 32 if M <= 32 else 64
    m_tiles = triton.cdiv(M, BM)
    for BN in ((128, 64) if BM == 16 else (64,)):
        if m_tiles * triton.cdiv(N, BN) >= sms:
            return BM, BN
    return BM, 32


def min_column_block(device: torch.device) -> int:
    """FP8 tensor-core dots take K >= 32 (the interpreter takes 16)."""
    return 32 if device.type == "cuda" else 16


def gemm_warps(BM: int, BN: int) -> int:
    """Each K step's dot result is scaled before it is added, so a program holds two [BM, BN] fp32
    tiles, and its [BM, 128] and [128, BN] tiles of operand addresses: from 64 x 64 on, four warps
    spill (sm_100), eight do not."""
    return 8 if BM * BN >= 64 * 64 else 4


def block_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """xq [M, K] FP8 with x_scale [M, ceil(K / bc)], weight [N, K] FP8 with scale_inv
    [ceil(N / br), ceil(K / bc)] -> [M, N] in out_dtype."""
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
    if xq.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("block FP8 GEMM needs x and weight with contiguous rows")
    interpreter_compat.install()
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    BM, BN = gemm_tiles(M, N)
    _block_fp8_gemm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        xq, x_scale, weight, scale_inv, bias if bias is not None else out, out,
        M, N, K, xq.stride(0), x_scale.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        BLOCK_ROWS=br, HAS_BIAS=bias is not None, BM=BM, BN=BN, BK=bc, num_warps=gemm_warps(BM, BN), num_stages=3,
    )
    return out


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] in bf16/fp16/fp32 -> x W^T (+ bias) [..., N] in x's dtype, W block-scaled FP8."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xq, xs = quantize_per_token_group(x2, block[1])
    return block_fp8_gemm(xq, xs, weight, scale_inv, block, x.dtype, bias).view(*lead, weight.shape[0])
