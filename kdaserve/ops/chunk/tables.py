"""Chunk tables for varlen chunked prefill, built on the host from the host copy of cu_seqlens.

Why on the host: the chunk count decides the grid size, and reading `cu_seqlens` from the device
would stall the stream (and break graph capture). The engine already has a host copy.

Every chunk lies inside one sequence (chunks never straddle sequences); a sequence of L tokens has
ceil(L / BT) chunks, the last one possibly partial; a 0-token sequence has none.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from kdaserve.ops.host_tables import StepTableCache, aligned, host_offsets, int32_to_device


@dataclass(slots=True)
class ChunkTables:
    """Device tables of one step.

    chunks: [num_chunks, 3] int32, per chunk (sequence n, first token, end token) in step coordinates.
    seq_first_chunk: [N] int32, global index of sequence n's first chunk (its row in the
        per-chunk state buffer written by the state pass and read by the output kernel).
    """

    chunks: torch.Tensor
    seq_first_chunk: torch.Tensor
    num_chunks: int


def chunk_table_values(offsets: tuple[int, ...], chunk_size: int) -> tuple[array, array]:
    """(chunks flattened [NC * 3], seq_first_chunk [N]) as int32 arrays, in plain Python (a step
    has a few thousand chunks at most; see kdaserve.ops.host_tables for why not torch ops)."""
    chunks, first = array("i"), array("i")
    for n in range(len(offsets) - 1):
        start, end = offsets[n], offsets[n + 1]
        if end < start:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {list(offsets)}")
        first.append(len(chunks) // 3)
        for t in range(start, end, chunk_size):
            chunks.extend((n, t, min(t + chunk_size, end)))
    return chunks, first


def host_chunk_tables(cu_seqlens_cpu: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunks [NC, 3], seq_first_chunk [N]) as int32 host tensors."""
    chunks, first = chunk_table_values(host_offsets(cu_seqlens_cpu), chunk_size)
    return (torch.tensor(chunks.tolist(), dtype=torch.int32).view(-1, 3),
            torch.tensor(first.tolist(), dtype=torch.int32))


def build_chunk_tables(offsets: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkTables:
    """Both tables in one host->device copy, each starting 128-byte aligned."""
    chunks, first = chunk_table_values(offsets, chunk_size)
    nc, pad = len(chunks) // 3, aligned(len(chunks))
    packed = int32_to_device(chunks + array("i", bytes(4 * (pad - len(chunks)))) + first, device)
    return ChunkTables(chunks=packed[: 3 * nc].view(nc, 3), seq_first_chunk=packed[pad:], num_chunks=nc)


class ChunkTableCache:
    """Builds the tables once per distinct cu_seqlens and reuses them for the step's other layers
    (kdaserve.ops.host_tables: keyed on the host copy's *contents*, so a caller refilling one
    buffer with new lengths gets new tables)."""

    def __init__(self) -> None:
        self._cache = StepTableCache()

    def get(self, cu_seqlens_cpu: torch.Tensor, chunk_size: int, device: torch.device) -> ChunkTables:
        offsets = host_offsets(cu_seqlens_cpu)
        return self._cache.get((offsets, chunk_size, device), device,
                               lambda: build_chunk_tables(offsets, chunk_size, device))
