"""Index tables a prefill builds on the host from `cu_seqlens_cpu`: cached per step, one copy each.

Why cache: every KDA layer of a step calls prefill with the same lengths (48+ layers in real models,
no CUDA graphs for prefill), so a table that depends only on the lengths (and the device, and the
block size) is built and sent to the device once per step, not once per layer. The key is the
*contents* of the host copy, never its address: engines refill one buffer in place every step.

Why plain Python to build them: a table has one entry per chunk or block (a few thousand at most),
and small torch CPU ops cost 5-20 µs each; `repeat_interleave` even runs a parallel region with
grain 1, waking every OpenMP thread of the host (milliseconds on a busy 2-core machine).

Why a pinned staging buffer: cudaMemcpyAsync from pageable memory may synchronize with the stream
(CUDA's API synchronization notes), which would make the host wait for the GPU mid-step.
"""

from __future__ import annotations

from array import array
from typing import Callable, Hashable, TypeVar

import torch

T = TypeVar("T")


def host_offsets(cu_seqlens_cpu: torch.Tensor) -> tuple[int, ...]:
    """The host copy's values as a hashable tuple (the cache key of a step's tables)."""
    return tuple(cu_seqlens_cpu.tolist())


def capturing(device: torch.device) -> bool:
    """Inside CUDA-graph capture a cached table would be baked into the graph and could be freed
    (evicted) before a replay reads it: callers build per call there, as without the cache."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class StepTableCache:
    """Tables of the last `capacity` distinct keys (a step, a mixed step's parts, a few backends:
    an engine interleaves few steps; the oldest entry goes first)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: dict = {}

    def get(self, key: Hashable, device: torch.device, build: Callable[[], T]) -> T:
        if capturing(device):
            return build()
        hit = self._entries.get(key)
        if hit is None:
            hit = build()
            if len(self._entries) >= self.capacity:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = hit
        return hit

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def int32_to_device(values: array, device: torch.device) -> torch.Tensor:
    """One host->device copy of an array('i') (int32); through pinned memory on CUDA. On the CPU
    the result owns a copy (it must not alias the array, which the caller may reuse)."""
    assert values.itemsize == 4, "int32 tables only"
    if len(values) == 0:
        return torch.empty(0, dtype=torch.int32, device=device)
    host = torch.frombuffer(values, dtype=torch.int32)
    if device.type == "cuda":
        staged = torch.empty(len(values), dtype=torch.int32, pin_memory=True)
        staged.copy_(host)
        # The caching host allocator keeps `staged` alive until the copy has run (it records an
        # event on the stream), so the buffer can be dropped right away.
        return staged.to(device, non_blocking=True)
    return host.to(device, copy=True)


def aligned(n: int, multiple: int = 32) -> int:
    """n rounded up: packed sub-tables start 128-byte aligned, so every view's pointer keeps the
    16-byte alignment Triton specializes on (same compiled variant as a fresh tensor)."""
    return -(-n // multiple) * multiple
