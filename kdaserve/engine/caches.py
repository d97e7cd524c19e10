"""Allocation of the step caches and their binding to the layers.

- KDA layers: a conv-state and a recurrent-state pool each, `[num_slots, ...]` as the layer's
  `cache_spec()` says; slot 0 is the null slot.
- Full-attention layers: K and V caches `[num_kv_blocks + 1, block_size, Hkv, D]`. Block 0 is the
  null block (zeros, never written: padding block-table entries point there). The extra last block
  is the trash block: padding rows of a CUDA-graph batch write their K/V there, so whatever they
  hold (even NaN) is never read, not even under a mask.

Everything starts zeroed: masked reads of stale rows then only ever see finite values.
"""

from __future__ import annotations

import math

import torch

from kdaserve.models.hybrid import HybridForCausalLM


def state_bytes_per_slot(model: HybridForCausalLM) -> int:
    total = 0
    for layer in model.kda_layers:
        for shape, dtype in layer.cache_spec().values():
            total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return total


def kv_bytes_per_block(model: HybridForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    per_layer = 2 * block_size * math.prod(_kv_head_shape(model)) * torch.empty((), dtype=dtype).element_size()
    return per_layer * len(model.attention_layers)


def _kv_head_shape(model: HybridForCausalLM) -> tuple[int, int]:
    c = model.config
    return c.num_key_value_heads, c.head_dim


class StepCaches:
    def __init__(self, model: HybridForCausalLM, num_slots: int, num_kv_blocks: int, block_size: int, kv_dtype, device):
        self.num_slots, self.num_kv_blocks, self.block_size = num_slots, num_kv_blocks, block_size
        self.kda: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in model.kda_layers:
            spec = layer.cache_spec()
            (conv_shape, conv_dtype), (rec_shape, rec_dtype) = spec["conv"], spec["recurrent"]
            conv = torch.zeros((num_slots, *conv_shape), dtype=conv_dtype, device=device)
            rec = torch.zeros((num_slots, *rec_shape), dtype=rec_dtype, device=device)
            layer.bind_cache(conv, rec)
            self.kda.append((conv, rec))
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for attn in model.attention_layers:
            shape = attn.cache_shape(num_kv_blocks + 1, block_size)
            k = torch.zeros(shape, dtype=kv_dtype, device=device)
            v = torch.zeros(shape, dtype=kv_dtype, device=device)
            attn.bind_cache(k, v)
            self.kv.append((k, v))

    @property
    def trash_row(self) -> int:
        """Flat KV row that CUDA-graph padding rows write to."""
        return self.num_kv_blocks * self.block_size
