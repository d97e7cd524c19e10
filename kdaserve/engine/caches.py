"""Allocation of the step caches and their binding to the layers.

- KDA layers: a conv-state and a recurrent-state pool each, `[num_slots, ...]` as the layer's
  `cache_spec()` says; slot 0 is the null slot.
- Attention layers: the tensors their `cache_shapes(num_blocks, block_size)` name, block-major:
  K and V `[num_kv_blocks + 1, block_size, Hkv, D]` for grouped-query attention, one latent cache
  `[num_kv_blocks + 1, block_size, L + R]` for MLA. Block 0 is the null block (zeros, never
  written: padding block-table entries point there). The extra last block is the trash block:
  padding rows of a CUDA-graph batch write their K/V there, so whatever they hold (even NaN) is
  never read, not even under a mask.

Everything starts zeroed: masked reads of stale rows then only ever see finite values.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def state_bytes_per_slot(model: nn.Module) -> int:
    total = 0
    for layer in model.kda_layers:
        for shape, dtype in layer.cache_spec().values():
            total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return total


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of `block_size` tokens takes in every attention layer's cache together."""
    elems = sum(math.prod(s) for layer in model.attention_layers for s in layer.cache_shapes(1, block_size))
    return elems * torch.empty((), dtype=dtype).element_size()


def format_bytes(n: int) -> str:
    """A size for an error message, in the largest binary unit that keeps it at 1 or more."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class StepCaches:
    def __init__(self, model: nn.Module, num_slots: int, num_kv_blocks: int, block_size: int, kv_dtype, device):
        self.num_slots, self.num_kv_blocks, self.block_size = num_slots, num_kv_blocks, block_size
        self.kda: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in model.kda_layers:
            spec = layer.cache_spec()
            (conv_shape, conv_dtype), (rec_shape, rec_dtype) = spec["conv"], spec["recurrent"]
            conv = torch.zeros((num_slots, *conv_shape), dtype=conv_dtype, device=device)
            rec = torch.zeros((num_slots, *rec_shape), dtype=rec_dtype, device=device)
            layer.bind_cache(conv, rec)
            self.kda.append((conv, rec))
        self.kv: list[tuple[torch.Tensor, ...]] = []
        for attn in model.attention_layers:
            tensors = tuple(torch.zeros(s, dtype=kv_dtype,
                                        device=device) for s in attn.cache_shapes(num_kv_blocks + 1, block_size))
            attn.bind_cache(*tensors)
            self.kv.append(tensors)

    @property
    def trash_row(self) -> int:
        """Flat KV row that CUDA-graph padding rows write to."""
        return self.num_kv_blocks * self.block_size
