"""FP8 block-scaled checkpoints (DeepSeek-V3's format, GLM-5.3-Flash's release): a quantized linear
weight `X.weight` [rows, cols] in float8_e4m3fn comes with `X.weight_scale_inv` [ceil(rows / br),
ceil(cols / bc)] in fp32, one factor per br x bc block (`quantization_config.weight_block_size`,
128 x 128 as released); the real weight is weight * scale_inv of its block.

Here the weights are dequantized once at load into the model's dtype (no FP8 GEMM yet), so every
device runs them. A weight without its scale, or a scale without its weight, is an error naming it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2") if hasattr(torch, n))


def fp8_block_size(config_extra: dict) -> tuple[int, int]:
    """weight_block_size of a config's quantization_config (top level or the outer config of a
    nested one); 128 x 128 when absent."""
    q = config_extra.get("quantization_config") or (config_extra.get("outer_config") or {}).get("quantization_config") or {}
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"quantization_config.weight_block_size must be two positive sizes, got {block}")
    return int(block[0]), int(block[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                         name: str = "weight") -> torch.Tensor:
    rows, cols = weight.shape
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}; a [{rows}, {cols}] weight in "
                         f"{br} x {bc} blocks needs {list(want)}")
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                        block: tuple[int, int] = (128, 128)) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with FP8 weights dequantized and their scales consumed. A weight
    and its scale may arrive in either order (different shards)."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            if base in weights_waiting:
                yield base, dequantize_block_fp8(weights_waiting.pop(base), t, block, dtype, base)
            else:
                scales_waiting[base] = t
        elif t.dtype in FP8_DTYPES:
            if name in scales_waiting:
                yield name, dequantize_block_fp8(t, scales_waiting.pop(name), block, dtype, name)
            else:
                weights_waiting[name] = t
        else:
            yield name, t
    if weights_waiting:
        raise ValueError(f"FP8 weights without their {SCALE_SUFFIX}: {sorted(weights_waiting)[:8]}")
    if scales_waiting:
        raise ValueError(f"{SCALE_SUFFIX} tensors without an FP8 weight: {sorted(s + SCALE_SUFFIX for s in scales_waiting)[:8]}")
