"""Moving recurrent states between our paged pool and the dense per-sequence tensors that external
kernels take, without touching slots outside the batch.

Both are device-only (no host reads) and so CUDA-graph capturable. A row whose slot is <= 0 reads
the null slot 0 (harmless) and writes back slot 0's own bits, unchanged: the pool is bit-for-bit
untouched outside the batch's real slots.
"""

from __future__ import annotations

import torch


def gather_states(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """pool[slots] as a dense [N, ...] tensor (in `dtype`); rows where `keep` is False are zeros
    (a prefill without history starts from a zero state)."""
    dense = pool.index_select(0, slots.reshape(-1).clamp(min=0).long())
    if dtype is not None:
        dense = dense.to(dtype)
    if keep is not None:
        dense = torch.where(keep.reshape(-1, *[1] * (dense.dim() - 1)), dense,
                            torch.zeros((), dtype=dense.dtype, device=dense.device))
    return dense


def scatter_states(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
    """pool[slots[i]] = values[i] where valid[i]; other rows write back what their slot held."""
    idx = slots.reshape(-1).clamp(min=0).long()
    old = pool.index_select(0, idx)
    mask = valid.reshape(-1, *[1] * (values.dim() - 1))
    pool.index_copy_(0, idx, torch.where(mask, values.to(pool.dtype), old))
