"""Chunk tables for varlen chunked prefill, built on the host from the host copy of cu_seqlens.

Why on the host: the chunk count decides the grid size, and reading `cu_seqlens` from the device
would stall the stream (and break graph capture). The engine already has a host copy.

Every chunk lies inside one sequence (chunks never straddle sequences); a sequence of L tokens has
ceil(L / BT) chunks, the last one possibly partial; a 0-token sequence has none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def host_chunk_tables(cu_seqlens_cpu: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunks [NC, 3], seq_first_chunk [N]) as int32 host tensors."""
    cu = cu_seqlens_cpu.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens_cpu.tolist()}")
    per_seq = (lens + chunk_size - 1) // chunk_size
    first = torch.cumsum(per_seq, 0) - per_seq
    seq = torch.repeat_interleave(torch.arange(lens.numel()), per_seq)
    start = cu[seq] + (torch.arange(seq.numel()) - first[seq]) * chunk_size
    end = torch.minimum(start + chunk_size, cu[seq + 1])
    chunks = torch.stack([seq, start, end], 1).to(torch.int32)
    return chunks, first.to(torch.int32)


class ChunkTableCache:
    """Builds the tables once per distinct cu_seqlens and reuses them for the step's other layers.

    The key is the *content* of the host copy (compared with torch.equal, a few hundred bytes at
    most), never its address, so a caller reusing a buffer with new lengths gets new tables.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._cu: torch.Tensor | None = None
        self._tables: ChunkTables | None = None

    def get(self, cu_seqlens_cpu: torch.Tensor, chunk_size: int, device: torch.device) -> ChunkTables:
        key = (chunk_size, str(device), cu_seqlens_cpu.numel())
        if self._key == key and self._cu is not None and torch.equal(self._cu, cu_seqlens_cpu):
            return self._tables
        chunks, first = host_chunk_tables(cu_seqlens_cpu, chunk_size)
        # One host->device copy for both tables; non_blocking from pageable memory stages the
        # bytes and returns without waiting for the device stream.
        packed = torch.cat([chunks.reshape(-1), first]).to(device, non_blocking=True)
        nc = chunks.shape[0]
        tables = ChunkTables(chunks=packed[: 3 * nc].view(nc, 3), seq_first_chunk=packed[3 * nc :], num_chunks=nc)
        self._key, self._cu, self._tables = key, cu_seqlens_cpu.clone(), tables
        return tables
