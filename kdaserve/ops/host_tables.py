"""Index tables a prefill builds on the host from `cu_seqlens_cpu`: cached per step, one copy each.

Why cache: every KDA layer of a step calls prefill with the same lengths (48+ layers in real models,
no CUDA graphs for prefill), so a table that depends only on the lengths (and the device, and the
block size) is built and sent to the device once per step, not once per layer. The key is the
*contents* of the host copy, never its address: engines refill one buffer in place every step.

Why numpy to build them, not torch: torch's CPU `repeat_interleave` runs a parallel region with
grain 1, waking every OpenMP thread of the host (up to milliseconds on a busy machine), and each
small torch op costs 5-20 µs of dispatch. numpy builds any table in 10-25 µs (a loop in plain
Python costs 2 µs for a few short sequences but 300 µs for a 64K-token one).

Why a pinned staging buffer: cudaMemcpyAsync from pageable memory may synchronize with the stream
(CUDA's API synchronization notes), which would make the host wait for the GPU mid-step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


def host_offsets(cu_seqlens_cpu: torch.Tensor) -> tuple[int, ...]:
    """The host copy's values as a hashable tuple (the cache key of a step's tables)."""
    return tuple(cu_seqlens_cpu.tolist())


def capturing(device: torch.device) -> bool:
    """Inside CUDA-graph capture a cached table would be baked into the graph and could be freed
    (evicted) before a replay reads it: callers build per call there, as without the cache."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# Pinned sources of host->device copies captured into a CUDA graph. A captured memcpy re-reads its
# source at every replay, but nothing ties the pinned block to the graph: once the event torch
# recorded for it during capture reads as complete, the caching host allocator hands the block out
# again (the next step's tables, a staging buffer...) and replays copy whatever lies there. Kept
# for the life of the process: a few hundred bytes per capture, and captures are rare.
_CAPTURED_SOURCES: list[torch.Tensor] = []


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

    def __len__(self) -> int:
        return len(self._entries)


def tables_to_device(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several int32 host tables in one host->device copy (through pinned memory on CUDA), returned
    as views of one device buffer. Each part starts 128-byte aligned, so every view keeps the 16-byte
    alignment Triton specializes on (the same compiled variant as a fresh tensor)."""
    starts, size = [], 0
    for p in parts:
        starts.append(size)
        size += -(-len(p) // 32) * 32
    # Filled in place through a numpy view; on CUDA that buffer is pinned. The caching host allocator
    # keeps a pinned block alive until the copy that reads it has run (it records an event on the
    # stream), so it can be dropped right away, except under graph capture (_CAPTURED_SOURCES). On
    # the CPU the "copy" is the buffer itself, which nothing else holds.
    host = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
    packed = host.numpy()
    for p, a in zip(parts, starts):
        packed[a : a + len(p)] = p
    buf = host.to(device, non_blocking=True)
    if capturing(device):
        _CAPTURED_SOURCES.append(host)
    return [buf[a : a + len(p)] for p, a in zip(parts, starts)]
