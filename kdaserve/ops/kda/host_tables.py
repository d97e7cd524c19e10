"""Index tables a prefill builds on the host from `cu_seqlens_cpu`, sent in one copy each.

Every KDA layer of a step calls prefill with the same lengths (48+ layers in real models, no CUDA
graphs for prefill), so the tables that depend only on the lengths are part of the step's plan,
built once per step before the layers run (conv_step_tables, flash_step_plan)
and passed to each layer; nothing here remembers a step.

Why numpy to build them, not torch: torch's CPU `repeat_interleave` runs a parallel region with
grain 1, waking every OpenMP thread of the host (up to milliseconds on a busy machine), and each
small torch op costs 5-20 µs of dispatch. numpy builds any table in 10-25 µs (a loop in plain
Python costs 2 µs for a few short sequences but 300 µs for a 64K-token one).

Why a pinned staging buffer: cudaMemcpyAsync from pageable memory may synchronize with the stream
(CUDA's API synchronization notes), which would make the host wait for the GPU mid-step.
"""

from __future__ import annotations

import numpy as np
import torch


def host_offsets(cu_seqlens_cpu: torch.Tensor) -> tuple[int, ...]:
    """The host copy's values as a tuple (what a step's tables are built from)."""
    return tuple(cu_seqlens_cpu.tolist())


def capturing(device: torch.device) -> bool:
    """Whether a copy made now is captured into a CUDA graph (its source must then outlive it)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# Pinned sources of host->device copies captured into a CUDA graph. A captured memcpy re-reads its
# source at every replay, but nothing ties the pinned block to the graph: once the event torch
# recorded for it during capture reads as complete, the caching host allocator hands the block out
# again (the next step's tables, a staging buffer...) and replays copy whatever lies there. Kept
# for the life of the process: a few hundred bytes per capture, and captures are rare.
_CAPTURED_SOURCES: list[torch.Tensor] = []


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
