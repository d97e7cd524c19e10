"""Host-side preparation of one step: token ids, positions, KDA and attention metadata, and the
rows whose logits are needed. Everything is computed from host data (Python ints, numpy) and
copied to the device once; nothing is read back from the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.engine.sequence import Sequence
from kdaserve.layers.attention import AttentionMetadata
from kdaserve.layers.context import Context, KDAStepMetadata


@dataclass
class LogitsRequest:
    """Rows of the step whose logits the sampler needs."""

    sample_rows: list[int] = field(default_factory=list)          # row of each sequence that samples
    sample_seqs: list[Sequence] = field(default_factory=list)
    # prompt log-probs: (sequence, step row, index of the prompt token that row predicts)
    prompt_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)


@dataclass
class HostStep:
    """The step as host arrays (what CUDA-graph replay copies into its static buffers)."""

    input_ids: np.ndarray        # [T] int64
    positions: np.ndarray        # [T] int64
    slot_mapping: np.ndarray     # [T] int64
    num_decodes: int
    decode_slots: np.ndarray     # [num_decodes] int32
    decode_block_tables: np.ndarray   # [num_decodes, width] int32
    decode_context_lens: np.ndarray   # [num_decodes] int32
    prefill_lens: list[int]
    prefill_context_lens: list[int]
    prefill_slots: np.ndarray    # [num_prefills] int32
    prefill_has_state: np.ndarray     # [num_prefills] bool
    prefill_kv_rows: np.ndarray  # [sum context lens] int64
    logits: LogitsRequest


def _rows(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Flat KV-cache rows of token positions [start, end)."""
    pos = np.arange(start, end, dtype=np.int64)
    return np.asarray(block_table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def build_host_step(batch: ScheduledBatch, block_size: int, decode_width: int | None = None) -> HostStep:
    """`decode_width`: block-table width of the decode rows (None: the batch's longest)."""
    ids, pos, slots_map = [], [], []
    logits = LogitsRequest()
    row = 0
    decodes = batch.decodes
    d_tables = [s.block_table for s in decodes]
    width = decode_width or max((len(t) for t in d_tables), default=1)
    decode_block_tables = np.zeros((len(decodes), width), dtype=np.int32)
    for i, seq in enumerate(decodes):
        p = seq.num_computed_tokens
        ids.append(seq.token_ids[p])
        pos.append(p)
        slots_map.append(seq.block_table[p // block_size] * block_size + p % block_size)
        decode_block_tables[i, : len(seq.block_table)] = seq.block_table
        _want_logits(logits, seq, row, p, 1)
        row += 1
    kv_rows = []
    for seq, n in zip(batch.prefills, batch.num_new_tokens):
        p = seq.num_computed_tokens
        ids.extend(seq.token_ids[p : p + n])
        pos.extend(range(p, p + n))
        slots_map.append(_rows(seq.block_table, p, p + n, block_size))
        kv_rows.append(_rows(seq.block_table, 0, p + n, block_size))
        _want_logits(logits, seq, row, p, n)
        row += n
    flat_slots = np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in slots_map]) if slots_map else np.zeros(0, np.int64)
    return HostStep(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.asarray(pos, dtype=np.int64),
        slot_mapping=flat_slots,
        num_decodes=len(decodes),
        decode_slots=np.asarray([s.state_slot for s in decodes], dtype=np.int32),
        decode_block_tables=decode_block_tables,
        decode_context_lens=np.asarray([s.num_computed_tokens + 1 for s in decodes], dtype=np.int32),
        prefill_lens=list(batch.num_new_tokens),
        prefill_context_lens=[s.num_computed_tokens + n for s, n in zip(batch.prefills, batch.num_new_tokens)],
        prefill_slots=np.asarray([s.state_slot for s in batch.prefills], dtype=np.int32),
        prefill_has_state=np.asarray([s.num_computed_tokens > 0 for s in batch.prefills], dtype=np.bool_),
        prefill_kv_rows=np.concatenate(kv_rows) if kv_rows else np.zeros(0, np.int64),
        logits=logits,
    )


def _want_logits(logits: LogitsRequest, seq: Sequence, row: int, start: int, n: int) -> None:
    """Rows [row, row+n) hold positions [start, start+n) of seq. The last one samples when it
    reaches the end of the sequence; rows that predict a prompt token not yet scored give prompt
    log-probs (the logits at position p predict token p+1)."""
    if start + n == seq.num_tokens:
        logits.sample_rows.append(row + n - 1)
        logits.sample_seqs.append(seq)
    if seq.needs_prompt_logprobs:
        first = max(start, len(seq.prompt_logprobs) - 1)
        for p in range(first, min(start + n, seq.num_prompt_tokens - 1)):
            logits.prompt_rows.append((seq, row + p - start, p + 1))


def to_device_context(step: HostStep, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Context]:
    """Eager path: device copies of the step and its Context (decode rows first)."""

    def dev(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype, non_blocking=True)

    nd = step.num_decodes
    num_prefills = len(step.prefill_lens)
    cu = np.zeros(num_prefills + 1, dtype=np.int32)
    np.cumsum(step.prefill_lens, out=cu[1:])
    kda = KDAStepMetadata(
        num_decodes=nd,
        num_decode_tokens=nd,
        decode_state_indices=dev(step.decode_slots, torch.int32) if nd else None,
        num_prefills=num_prefills,
        num_prefill_tokens=int(cu[-1]),
        prefill_cu_seqlens=dev(cu, torch.int32) if num_prefills else None,
        prefill_cu_seqlens_cpu=torch.from_numpy(cu) if num_prefills else None,
        prefill_state_indices=dev(step.prefill_slots, torch.int32) if num_prefills else None,
        prefill_has_initial_state=dev(step.prefill_has_state, torch.bool) if num_prefills else None,
    )
    attn = AttentionMetadata(
        slot_mapping=dev(step.slot_mapping, torch.int64),
        num_decode_tokens=nd,
        decode_block_tables=dev(step.decode_block_tables, torch.int32) if nd else None,
        decode_context_lens=dev(step.decode_context_lens, torch.int32) if nd else None,
        prefill_query_lens=step.prefill_lens,
        prefill_context_lens=step.prefill_context_lens,
        prefill_kv_rows=dev(step.prefill_kv_rows, torch.int64) if num_prefills else None,
    )
    input_ids = dev(step.input_ids, torch.int64)
    positions = dev(step.positions, torch.int64)
    return input_ids, positions, Context(kda=kda, attn=attn)
