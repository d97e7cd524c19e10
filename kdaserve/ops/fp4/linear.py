"""A linear layer with 4-bit weights (Triton, W4A16): y = x W^T (+ bias), W in ops/fp4/weights.py's
form, decoded in registers per K step as the fused MoE kernels decode their experts (tiles.py); MXFP4
with bf16 / fp16 x through tl.dot_scaled where the target multiplies fp4 (as the MoE kernels).

One program per (BM rows, BN output columns) tile. Rows and columns past the edge wrap around
instead of being masked, as the FP8 GEMM does (ops/fp8/block_gemm.py): the loads stay unmasked and
the store drops them. Tiles by batch size: 16 rows at decode (the cost is the weight's bytes, read
once per 16 rows), wider at prefill."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat
from kdaserve.ops.fp4.tiles import (
    decoded_dot,
    fp4_weight_tile,
    k_step_offsets,
    mxfp4_scaled_dot,
)
from kdaserve.ops.fp4.weights import Fp4Weights
from kdaserve.ops.fp4.word_decode import nvfp4_words_restored, words_decode, words_wide
from kdaserve.ops.precision import device_target, dot_precision, native_fp4_dots


@triton.jit
def _fp4_linear_kernel(
    x_ptr, w_ptr, s_ptr, d_ptr, bias_ptr, y_ptr,
    M, N, K, stride_x, stride_w, stride_s, stride_y,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    W4_DOT: tl.constexpr = False, A_FORMAT: tl.constexpr = "bf16", W4_WORDS: tl.constexpr = False,
    W4_LEFT: tl.constexpr = False, W4_WIDE: tl.constexpr = False,
):
    """W4_LEFT: the decoded tiles are the dots' left operands (acc^T = W x^T, K in fragment order:
    tiles.in_fragment_order), as the fused MoE kernels take them at decode on Hopper. W4_WORDS,
    W4_WIDE: decoded by the words program (ops/fp4/word_decode.py), the WIDE one."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rows_in = (rows % M).to(tl.int64)
    cols_in = (cols % N).to(tl.int64)
    acc = tl.zeros([BN, BM] if W4_LEFT else [BM, BN], tl.float32)
    w_rows, s_rows = w_ptr + cols_in[:, None] * stride_w, s_ptr + cols_in[:, None] * stride_s
    for k0 in range(0, K, BK):
        ks = k0 + k_step_offsets(BK, W4_LEFT)
        a = tl.load(x_ptr + rows_in[:, None] * stride_x + ks[None, :], mask=((ks < K) | EVEN_K)[None, :], other=0.0)
        if W4_DOT:
            acc = mxfp4_scaled_dot(a, w_rows, s_rows, True, k0, K, acc, BK, EVEN_K, A_FORMAT)
        else:
            w = fp4_weight_tile(w_rows, s_rows, True, k0, K, BK, GROUP, EVEN_K, a.dtype, W4_WORDS, W4_WIDE)
            acc = decoded_dot(a, w, acc, W4_LEFT, PREC)
    if W4_LEFT:
        acc = tl.trans(acc)
    if GROUP == 16:   # NVFP4's global scale divides, per output row of W
        if W4_WORDS:
            acc = nvfp4_words_restored(acc)
        acc = acc / tl.load(d_ptr + cols_in)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def fp4_tiles(m: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, warps) for m rows: decode-sized batches read the weight once per 16 rows."""
    if m <= 16:
        return 16, 64, 128, 4
    if m <= 128:
        return 64, 64, 64, 4
    return 128, 64, 64, 8


def fp4_linear(x: torch.Tensor, w: Fp4Weights, bias: torch.Tensor | None = None,
               fp4_dots: bool | None = None, fp4_left: bool = False, fp4_words: bool | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype; the definition is F.linear(x, w.dequantized(x.dtype), bias).
    `fp4_dots`: force tl.dot_scaled (MXFP4, bf16 / fp16 x) on or off; None: where the target multiplies fp4.
    `fp4_left`: the decoded tiles on the left of the dots (not the default: tiles.fp4_weights_left
    says why), decoded there by the words program as the MoE kernels do; `fp4_words` forces the decoder
    (tests; it needs an NVIDIA GPU, bf16 x and codes in whole words: word_decode.words_decode)."""
    out_features, in_features = w.shape
    if x.shape[-1] != in_features or w.packed.dim() != 2:
        raise ValueError(f"a 4-bit linear layer of {in_features} inputs needs x [..., {in_features}], got {list(x.shape)}")
    interpreter_compat.install()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    w = w.dense_rows()
    M = x2.shape[0]
    y = torch.empty(M, out_features, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*lead, out_features)
    BM, BN, BK, warps = fp4_tiles(M)
    BK = max(32, min(BK, triton.next_power_of_2(in_features)))
    prec = "ieee" if x.dtype == torch.float32 else dot_precision(x.device).tensor_core
    div = w.divisor if w.divisor is not None else w.scale   # unused for MXFP4
    b = bias if bias is not None else y
    dot = (w.group == 32 and x.dtype in (torch.bfloat16, torch.float16)
           and (native_fp4_dots(device_target(x.device)) if fp4_dots is None else fp4_dots))
    left = not dot and x.dtype in (torch.bfloat16, torch.float16) and fp4_left
    words = not dot and words_decode(x, left, fp4_words, w.packed)
    _fp4_linear_kernel[(triton.cdiv(M, BM), triton.cdiv(out_features, BN))](
        x2, w.packed, w.scale, div, b, y, M, out_features, in_features, x2.stride(0), w.packed.stride(0),
        w.scale.stride(0), y.stride(0), GROUP=w.group, HAS_BIAS=bias is not None, EVEN_K=in_features % BK == 0,
        BM=BM, BN=BN, BK=BK, PREC=prec, W4_DOT=dot, A_FORMAT="bf16" if x.dtype == torch.bfloat16 else "fp16",
        W4_LEFT=left, W4_WORDS=words, W4_WIDE=words_wide(words, w.group, w.scale),
        num_warps=warps)
    return y.view(*lead, out_features)
