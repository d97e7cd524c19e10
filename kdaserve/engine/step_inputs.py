"""Host-side preparation of one step: token ids, positions, KDA and attention metadata, and the
rows whose logits are needed. Everything is computed from host data (Python ints, numpy) and
copied to the device in one non-blocking copy (staging.py); nothing is read back from the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.staging import PackedLayout, StagingRing
from kdaserve.layers.attention import AttentionMetadata
from kdaserve.layers.context import Context, KDAStepMetadata


@dataclass
class LogitsRequest:
    """Rows of the step whose logits the sampler needs."""

    sample_rows: list[int] = field(default_factory=list)          # row of each sequence that samples
    sample_seqs: list[Sequence] = field(default_factory=list)
    # prompt log-probs: (sequence, step row, index of the prompt token that row predicts)
    prompt_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)

    @property
    def sample_rows_are_leading(self) -> bool:
        """Rows 0..n-1 (every decode row samples, the usual case): a slice of the hidden states
        selects them, no index tensor needed. Rows are increasing, so the last one tells."""
        rows = self.sample_rows
        return not rows or rows[-1] == len(rows) - 1


@dataclass
class HostStep:
    """The step as host arrays (what CUDA-graph replay copies into its static buffers)."""

    input_ids: np.ndarray        # [T] int64
    positions: np.ndarray        # [T] int64
    slot_mapping: np.ndarray     # [T] int64
    num_decodes: int
    decode_slots: np.ndarray     # [num_decodes] int32
    decode_tables: list[np.ndarray]   # [num_decodes] block tables (int32), each at most decode_width long
    decode_width: int                 # block-table width of the decode rows
    decode_context_lens: np.ndarray   # [num_decodes] int32
    prefill_lens: list[int]
    prefill_context_lens: list[int]
    prefill_slots: np.ndarray    # [num_prefills] int32
    prefill_has_state: np.ndarray     # [num_prefills] bool
    prefill_kv_rows: np.ndarray  # [sum context lens] int64
    logits: LogitsRequest

    @property
    def decode_block_tables(self) -> np.ndarray:
        """[num_decodes, decode_width] int32, zero-padded (tests and tools; the engine writes the
        rows straight into its staging buffer)."""
        out = np.zeros((self.num_decodes, self.decode_width), dtype=np.int32)
        write_block_tables(out, self.decode_tables)
        return out


def write_block_tables(dst: np.ndarray, tables: list[np.ndarray]) -> None:
    """`dst` [>= len(tables), width]: row i = tables[i] zero-padded, rows past them all zeros
    (0 = the null block: what padding entries and padding rows point at)."""
    dst[...] = 0
    for row, table in zip(dst, tables):
        row[: table.shape[0]] = table


def _rows(block_table: np.ndarray, start: int, end: int, block_size: int) -> np.ndarray:
    """Flat KV-cache rows of token positions [start, end)."""
    pos = np.arange(start, end, dtype=np.int64)
    return block_table[pos // block_size].astype(np.int64) * block_size + pos % block_size


def build_host_step(batch: ScheduledBatch, block_size: int, decode_width: int | None = None) -> HostStep:
    """`decode_width`: block-table width of the decode rows (None: the batch's longest)."""
    logits = LogitsRequest()
    decodes = batch.decodes
    nd = len(decodes)
    # Decode rows: one token each, by list comprehensions (a decode step of 64 sequences is all
    # host time; per-row numpy calls cost more than the rows' arithmetic).
    pos = [s.num_computed_tokens for s in decodes]
    ids = [s.token_ids[p] for s, p in zip(decodes, pos)]
    slots_map = [s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(decodes, pos)]
    tables = [s.block_table_array() for s in decodes]
    for row, (seq, p) in enumerate(zip(decodes, pos)):
        if p + 1 == len(seq.token_ids):
            logits.sample_rows.append(row)
            logits.sample_seqs.append(seq)
        if seq.needs_prompt_logprobs:
            _want_prompt_logprobs(logits, seq, row, p, 1)
    decode_lens = np.asarray(pos, dtype=np.int32) + 1
    # Prefill rows.
    row = nd
    kv_rows, prefill_slots_map = [], []
    for seq, n in zip(batch.prefills, batch.num_new_tokens):
        p = seq.num_computed_tokens
        ids.extend(seq.token_ids[p : p + n])
        pos.extend(range(p, p + n))
        table = seq.block_table_array()
        prefill_slots_map.append(_rows(table, p, p + n, block_size))
        kv_rows.append(_rows(table, 0, p + n, block_size))
        _want_logits(logits, seq, row, p, n)
        row += n
    flat_slots = np.asarray(slots_map, dtype=np.int64)
    if prefill_slots_map:
        flat_slots = np.concatenate([flat_slots, *prefill_slots_map])
    return HostStep(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.asarray(pos, dtype=np.int64),
        slot_mapping=flat_slots,
        num_decodes=nd,
        decode_slots=np.asarray([s.state_slot for s in decodes], dtype=np.int32),
        decode_tables=tables,
        decode_width=decode_width or _eager_width(tables),
        decode_context_lens=decode_lens,
        prefill_lens=list(batch.num_new_tokens),
        prefill_context_lens=[s.num_computed_tokens + n for s, n in zip(batch.prefills, batch.num_new_tokens)],
        prefill_slots=np.asarray([s.state_slot for s in batch.prefills], dtype=np.int32),
        prefill_has_state=np.asarray([s.num_computed_tokens > 0 for s in batch.prefills], dtype=np.bool_),
        prefill_kv_rows=np.concatenate(kv_rows) if kv_rows else np.zeros(0, np.int64),
        logits=logits,
    )


def _eager_width(tables: list[np.ndarray]) -> int:
    """Block-table width of an eager step's decode rows: the longest table, rounded up to a
    multiple of 16. The width is the row stride of the paged-attention kernel, which Triton
    specializes (1, a multiple of 16, anything else); rounded, every step shares one variant."""
    longest = max((t.shape[0] for t in tables), default=1)
    return -(-longest // 16) * 16


def _want_logits(logits: LogitsRequest, seq: Sequence, row: int, start: int, n: int) -> None:
    """Rows [row, row+n) hold positions [start, start+n) of seq. The last one samples when it
    reaches the end of the sequence; rows that predict a prompt token not yet scored give prompt
    log-probs (the logits at position p predict token p+1)."""
    if start + n == seq.num_tokens:
        logits.sample_rows.append(row + n - 1)
        logits.sample_seqs.append(seq)
    if seq.needs_prompt_logprobs:
        _want_prompt_logprobs(logits, seq, row, start, n)


def _want_prompt_logprobs(logits: LogitsRequest, seq: Sequence, row: int, start: int, n: int) -> None:
    first = max(start, len(seq.prompt_logprobs) - 1)
    for p in range(first, min(start + n, seq.num_prompt_tokens - 1)):
        logits.prompt_rows.append((seq, row + p - start, p + 1))


@dataclass
class DeviceStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: Context
    sample_rows: torch.Tensor | None   # [num sample rows] int64; None: rows 0..n-1 (take a slice)


def to_device_context(step: HostStep, device: torch.device, ring: StagingRing) -> DeviceStep:
    """Eager path: the step's arrays packed into a buffer of `ring`, one non-blocking copy into a
    fresh device buffer, and the Context as views of it (decode rows first)."""
    nd = step.num_decodes
    num_prefills = len(step.prefill_lens)
    T = step.input_ids.shape[0]
    cu = np.zeros(num_prefills + 1, dtype=np.int32)
    np.cumsum(step.prefill_lens, out=cu[1:])
    rows = step.logits.sample_rows
    staged_rows = not step.logits.sample_rows_are_leading
    i64, i32 = torch.int64, torch.int32
    layout = PackedLayout([
        ("input_ids", i64, (T,)), ("positions", i64, (T,)), ("slot_mapping", i64, (T,)),
        ("prefill_kv_rows", i64, step.prefill_kv_rows.shape), ("sample_rows", i64, (len(rows) if staged_rows else 0,)),
        ("decode_slots", i32, (nd,)), ("decode_context_lens", i32, (nd,)), ("decode_block_tables", i32, (nd, step.decode_width)),
        ("prefill_cu_seqlens", i32, (num_prefills + 1 if num_prefills else 0,)), ("prefill_slots", i32, (num_prefills,)),
        ("prefill_has_state", torch.bool, (num_prefills,)),
    ])
    buf, host = ring.acquire(layout.nbytes)
    h = layout.host_views(host)
    h["input_ids"][:] = step.input_ids
    h["positions"][:] = step.positions
    h["slot_mapping"][:] = step.slot_mapping
    h["prefill_kv_rows"][:] = step.prefill_kv_rows
    if staged_rows:
        h["sample_rows"][:] = rows
    h["decode_slots"][:] = step.decode_slots
    h["decode_context_lens"][:] = step.decode_context_lens
    write_block_tables(h["decode_block_tables"], step.decode_tables)
    if num_prefills:
        h["prefill_cu_seqlens"][:] = cu
    h["prefill_slots"][:] = step.prefill_slots
    h["prefill_has_state"][:] = step.prefill_has_state
    dev = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    ring.submit(buf, dev, layout.nbytes)
    d = layout.device_views(dev)
    kda = KDAStepMetadata(
        num_decodes=nd,
        num_decode_tokens=nd,
        decode_state_indices=d["decode_slots"] if nd else None,
        num_prefills=num_prefills,
        num_prefill_tokens=int(cu[-1]),
        prefill_cu_seqlens=d["prefill_cu_seqlens"] if num_prefills else None,
        prefill_cu_seqlens_cpu=torch.from_numpy(cu) if num_prefills else None,
        prefill_state_indices=d["prefill_slots"] if num_prefills else None,
        prefill_has_initial_state=d["prefill_has_state"] if num_prefills else None,
    )
    attn = AttentionMetadata(
        slot_mapping=d["slot_mapping"],
        num_decode_tokens=nd,
        decode_block_tables=d["decode_block_tables"] if nd else None,
        decode_context_lens=d["decode_context_lens"] if nd else None,
        prefill_query_lens=step.prefill_lens,
        prefill_context_lens=step.prefill_context_lens,
        prefill_kv_rows=d["prefill_kv_rows"] if num_prefills else None,
    )
    return DeviceStep(d["input_ids"], d["positions"], Context(kda=kda, attn=attn), d["sample_rows"] if staged_rows else None)
