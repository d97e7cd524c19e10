"""A linear layer whose weight is several checkpoint tensors stacked along the output dim
(q|k|v, gate|up): one GEMM instead of several. Each shard is written by `load_shard`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    def __init__(self, in_features: int, shard_sizes: list[int], *, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.in_features, self.shard_sizes = in_features, list(shard_sizes)
        self.offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes) + 1)]
        out = self.offsets[-1]
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype, device=device), requires_grad=False) if bias else None

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into rows [offsets[shard], offsets[shard+1]) of weight/bias."""
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {param_name!r} for a linear layer built without one")
        lo, hi = self.offsets[shard], self.offsets[shard + 1]
        expected = (hi - lo, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shard {shard} of {param_name} must have shape {expected}, got {tuple(tensor.shape)}")
        param.data[lo:hi].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
