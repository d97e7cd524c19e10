"""Grouping a step's (token, expert) pairs by expert for the grouped GEMM, on the device.

A step routes T tokens to k experts each: S = T*k slots, slot s = token s // k, choice s % k.
The slots are sorted by expert and each expert's run is padded to a multiple of `block_m`, so a
program of the grouped GEMM takes `block_m` consecutive sorted entries that all belong to one
expert. Padding entries hold S (no slot). The number of blocks is bounded on the host without
looking at the routing (S + min(S, E) * (block_m - 1) entries), so the grid never depends on the
data: no device->host sync, and a CUDA graph can capture it; blocks past the end get expert -1
and return at once.
"""

from __future__ import annotations

import torch


def max_sorted_entries(num_slots: int, num_experts: int, block_m: int) -> int:
    n = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return -(-n // block_m) * block_m


def align_to_experts(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_slots [n] int32, block_experts [n // block_m] int32, -1 past the end)."""
    flat = ids.reshape(-1).to(torch.int64)
    S = flat.numel()
    dev = flat.device
    n = max_sorted_entries(S, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)           # slots grouped by expert, in slot order
    expert_of_sorted = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(S, device=dev) - first_of_expert[expert_of_sorted]
    sorted_slots = torch.full((n,), S, dtype=torch.int32, device=dev)
    sorted_slots[starts[expert_of_sorted] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, n, block_m, device=dev)
    block_experts = torch.searchsorted(ends, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_slots, block_experts
