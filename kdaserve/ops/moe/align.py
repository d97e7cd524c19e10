"""Grouping a step's (token, expert) pairs by expert for the grouped GEMM, on the device.

A step routes T tokens to k experts each: S = T*k slots, slot s = token s // k, choice s % k.
The slots are sorted by expert and each expert's run is padded to a multiple of `block_m`, so a
program of the grouped GEMM takes `block_m` consecutive sorted entries that all belong to one
expert. Padding entries hold S (no slot). The number of blocks is bounded on the host without
looking at the routing (S + min(S, E) * (block_m - 1) entries), so the grid never depends on the
data: no device->host sync, and a CUDA graph can capture it; blocks past the end get expert -1
and return at once.

Two implementations with identical results (slots of one expert in slot order): up to
KERNEL_MAX_SLOTS slots (small decode batches) one Triton program does it in one launch, since at
batch 1 the ~20 small torch launches of the general path cost more than the experts' GEMMs
(docs/perf-notes.md, fourteenth session); past it, the torch path (a sort). One program walks
the slots serially, so its time grows with them: the threshold sits below the crossover that
bench_moe_mla.py's "MoE align" rows show on an H200 (docs/perf-notes.md, fifteenth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat

KERNEL_MAX_SLOTS = 1024


def max_sorted_entries(num_slots: int, num_experts: int, block_m: int) -> int:
    n = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return -(-n // block_m) * block_m


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_experts_ptr, S, n,
                  E: tl.constexpr, E_P: tl.constexpr, BM: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: count slots per expert, pad each run to BM, then place every slot at its
    expert's start + its rank among that expert's earlier slots, and name each block's expert.
    A slot's rank comes from an exclusive cumulative sum of the one-hot [slots, experts] tile."""
    experts = tl.arange(0, E_P)
    counts = tl.zeros([E_P], tl.int32)
    for s0 in range(0, S, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        e = tl.load(ids_ptr + offs, mask=offs < S, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    for p0 in range(0, n, BLOCK_S):   # padding entries hold S (no slot)
        offs = p0 + tl.arange(0, BLOCK_S)
        tl.store(sorted_ptr + offs, tl.full([BLOCK_S], 0, tl.int32) + S, mask=offs < n)
    tl.debug_barrier()   # every fill lands before a slot overwrites it
    placed = tl.zeros([E_P], tl.int32)
    for s0 in range(0, S, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        e = tl.load(ids_ptr + offs, mask=offs < S, other=-1).to(tl.int32)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(hot, 0) - hot + (starts + placed)[None, :]
        dest = tl.sum(hot * rank, 1)
        tl.store(sorted_ptr + dest, offs, mask=offs < S)
        placed += tl.sum(hot, 0)
    for b0 in range(0, n // BM, BLOCK_S):   # a block's expert: how many runs end at or before its start
        blocks = b0 + tl.arange(0, BLOCK_S)
        owner = tl.sum((ends[None, :] <= (blocks * BM)[:, None]).to(tl.int32), 1)
        tl.store(block_experts_ptr + blocks, tl.where(owner < E, owner, -1), mask=blocks < n // BM)


def align_to_experts(ids: torch.Tensor, num_experts: int, block_m: int, *,
                     use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_slots [n] int32, block_experts [n // block_m] int32, -1 past the end).
    `use_kernel`: None = the one-launch kernel on a GPU up to KERNEL_MAX_SLOTS slots (the torch
    path otherwise); True / False force one (tests)."""
    S = ids.numel()
    if use_kernel is None:
        use_kernel = ids.is_cuda and 0 < S <= KERNEL_MAX_SLOTS
    if use_kernel:
        return _align_with_kernel(ids, num_experts, block_m)
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


def _align_with_kernel(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    interpreter_compat.install()
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    S = flat.numel()
    n = max_sorted_entries(S, num_experts, block_m)
    sorted_slots = torch.empty(n, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(n // block_m, dtype=torch.int32, device=ids.device)
    E_P = max(16, triton.next_power_of_2(num_experts))
    _align_kernel[(1,)](flat, sorted_slots, block_experts, S, n, E=num_experts, E_P=E_P, BM=block_m,
                        BLOCK_S=max(16, min(64, 8192 // E_P)), num_warps=4)
    return sorted_slots, block_experts
