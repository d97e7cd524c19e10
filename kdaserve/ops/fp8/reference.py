"""Block-scaled FP8 in plain torch: the definitions the Triton kernels are judged by.

    weight     W[r, c] = Wq[r, c] * S[r // br, c // bc]           (Wq float8_e4m3fn, S fp32)
    activation x[t, c] = xq[t, c] * s[t, c // g]                   s = max|x[t, group]| / 448
    linear     y[t, r] = sum over K blocks of (xq Wq^T)[t, r] * s[t, kb] * S[r // br, kb]

which is the dequantized product; the kernels only reorder the sums (fp32 accumulation)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-10      # an all-zero group keeps a finite scale (its values quantize to 0)


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Wq [..., rows, cols] with S [..., ceil(rows / br), ceil(cols / bc)] -> W in `dtype`."""
    rows, cols = weight.shape[-2:]
    br, bc = block
    scale = scale_inv.float().repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., rows, cols] -> (Wq, S) with S = max|W| of each block / 448: how DeepSeek-V3's
    checkpoints are made; used to quantize weights that arrive in bf16 and to write test checkpoints."""
    *lead, rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = weight.float().new_zeros(*lead, nr * br, nc * bc)
    padded[..., :rows, :cols] = weight.float()
    blocks = padded.view(*lead, nr, br, nc, bc)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(SCALE_FLOOR) / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(*lead, nr * br, nc * bc)
    return q[..., :rows, :cols].to(FP8), scale


def quantize_per_token_group_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] float8_e4m3fn, s [T, ceil(K / group)] fp32), s = max|group| / 448."""
    q, s = quantize_blocks(x, (1, group))
    return q, s


def block_fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                               block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with x quantized per token and group of block[1] columns, as the kernel
    does: x [T, K] -> [T, N] in x's dtype."""
    xq, xs = quantize_per_token_group_reference(x, block[1])
    y = dequantize_blocks(xq, xs, (1, block[1])) @ dequantize_blocks(weight, scale_inv, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
