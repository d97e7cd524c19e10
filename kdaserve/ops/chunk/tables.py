"""Chunk tables for varlen chunked prefill, built on the host from the host copy of cu_seqlens.

Why on the host: the chunk count decides the grid size, and reading `cu_seqlens` from the device
would stall the stream (and break graph capture). The engine already has a host copy.

Every chunk lies inside one sequence (chunks never straddle sequences); a sequence of L tokens has
ceil(L / BT) chunks, the last one possibly partial; a 0-token sequence has none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kdaserve.ops.host_tables import host_offsets, tables_to_device


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


def chunk_table_values(offsets: tuple[int, ...], chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunks [NC, 3], seq_first_chunk [N]) as int32 numpy arrays (kdaserve.ops.host_tables: why numpy)."""
    cu = np.array(offsets, dtype=np.int64)
    lens = cu[1:] - cu[:-1]
    if lens.size and lens.min() < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {list(offsets)}")
    per_seq = -(-lens // chunk_size)
    first = np.cumsum(per_seq) - per_seq
    seq = np.repeat(np.arange(lens.size), per_seq)
    start = cu[seq] + (np.arange(seq.size) - first[seq]) * chunk_size
    end = np.minimum(start + chunk_size, cu[seq + 1])
    return np.stack([seq, start, end], 1).astype(np.int32), first.astype(np.int32)


def host_chunk_tables(cu_seqlens_cpu: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunks [NC, 3], seq_first_chunk [N]) as int32 host tensors."""
    chunks, first = chunk_table_values(host_offsets(cu_seqlens_cpu), chunk_size)
    return torch.from_numpy(chunks), torch.from_numpy(first)


def build_chunk_tables(offsets: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkTables:
    """Both tables in one host->device copy."""
    chunks, first = chunk_table_values(offsets, chunk_size)
    flat, seq_first_chunk = tables_to_device([chunks.reshape(-1), first], device)
    return ChunkTables(chunks=flat.view(-1, 3), seq_first_chunk=seq_first_chunk, num_chunks=chunks.shape[0])
