"""Host-side preparation of one step: token ids, positions, KDA and attention metadata, and the
rows whose logits are needed. Everything is computed from host data (Python ints, numpy) and
copied to the device in one non-blocking copy (staging.py); nothing is read back from the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kdaserve.backends.kda_backends import KDABackends
from kdaserve.engine.encoder_cache import StepImages
from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.speculative.rejection_sampler import SampleGroup
from kdaserve.engine.staging import PackedLayout, StagingRing
from kdaserve.engine.step_context import build_context
from kdaserve.layers.context import Context
from kdaserve.ops.kda.types import CheckpointRequests, checkpoint_table_width


@dataclass
class LogitsRequest:
    """Rows of the step whose logits the sampler needs."""

    sample_rows: list[int] = field(default_factory=list)          # row of each sequence that samples
    sample_seqs: list[Sequence] = field(default_factory=list)
    # prompt log-probs: (sequence, step row, index of the prompt token that row predicts)
    prompt_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)
    # With speculative decoding: every sampling sequence as a group of consecutive sample rows
    # (a verify's 1 + drafts rows, a finished prefill's one), positions counted in sample_rows.
    groups: list[SampleGroup] | None = None

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
    num_decodes: int                  # decode sequences (each a verify of tokens_per_decode tokens when > 1)
    decode_state_indices: np.ndarray  # [num_decodes] int32: each sequence's state slot
    decode_tables: list[np.ndarray] | np.ndarray   # a block table (int32) per decode row, at most decode_width
                                                   # long (verify steps: one zero-padded 2-D array)
    decode_width: int                 # block-table width of the decode rows
    decode_context_lens: np.ndarray   # [decode rows] int32
    prefill_query_lens: list[int]     # new tokens per prefill sequence
    prefill_context_lens: list[int]   # cached + new tokens
    prefill_state_indices: np.ndarray      # [num_prefills] int32
    prefill_has_initial_state: np.ndarray  # [num_prefills] bool
    prefill_kv_rows: np.ndarray  # [sum context lens] int64
    logits: LogitsRequest
    # Speculative verify (tokens_per_decode = S+1 > 1): the attention layers see each of a verify's
    # S+1 tokens as a decode row whose context ends at that token; the KDA layers resume each
    # sequence from spec_state_indices[n, num_accepted_tokens[n] - 1] and keep the state after
    # token t in [n, t].
    tokens_per_decode: int = 1
    spec_state_indices: np.ndarray | None = None    # [num_decodes, S+1] int32
    num_accepted_tokens: np.ndarray | None = None   # [num_decodes] int32
    # Prefix caching: per prefill, the (offset, checkpoint slot)s its launch writes; None: none.
    prefill_checkpoints: list[list[tuple[int, int]]] | None = None
    checkpoint_width: int = 0    # columns of their staged table (ScheduledBatch.checkpoint_width)
    # The step's image embeddings (engine/encoder_cache.py): None without image placeholders.
    images: StepImages | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes * self.tokens_per_decode

    @property
    def decode_block_tables(self) -> np.ndarray:
        """[decode rows, decode_width] int32, zero-padded (tests and tools; the engine writes the
        rows straight into its staging buffer)."""
        out = np.zeros((self.num_decode_tokens, self.decode_width), dtype=np.int32)
        write_block_tables(out, self.decode_tables)
        return out


def write_block_tables(dst: np.ndarray, tables: list[np.ndarray] | np.ndarray) -> None:
    """`dst` [>= len(tables), width]: row i = tables[i] zero-padded, rows past them all zeros
    (0 = the null block: what padding entries and padding rows point at). `tables` may also be
    one zero-padded 2-D array (verify steps: each table repeated for its S+1 rows)."""
    dst[...] = 0
    if isinstance(tables, np.ndarray):
        dst[: tables.shape[0], : tables.shape[1]] = tables
        return
    for row, table in zip(dst, tables):
        row[: table.shape[0]] = table


def _rows(block_table: np.ndarray, start: int, end: int, block_size: int) -> np.ndarray:
    """Flat KV-cache rows of token positions [start, end)."""
    pos = np.arange(start, end, dtype=np.int64)
    return block_table[pos // block_size].astype(np.int64) * block_size + pos % block_size


def build_host_step(batch: ScheduledBatch, block_size: int, decode_width: int | None = None, trash_row: int = 0) -> HostStep:
    """`decode_width`: block-table width of the decode rows (None: the batch's longest).
    `trash_row`: the KV row that padded draft positions of a verify write (read by nobody)."""
    logits = LogitsRequest(groups=[] if batch.spec_tokens else None)
    decodes = batch.decodes
    nd = len(decodes)
    m = batch.tokens_per_decode
    verify_slots = accepted = None
    if m > 1:
        ids, pos, slots_map, decode_lens, tables = _verify_rows(decodes, m, block_size, trash_row, logits)
        verify_slots = np.asarray([s.verify_slots for s in decodes], dtype=np.int32).reshape(nd, m)
        accepted = np.asarray([s.num_accepted for s in decodes], dtype=np.int32)
    else:
        # Decode rows: one token each, by list comprehensions (a decode step of 64 sequences is all
        # host time; per-row numpy calls cost more than the rows' arithmetic).
        pos = [s.num_computed_tokens for s in decodes]
        slots_map = [s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(decodes, pos)]
        tables = [s.block_table_array() for s in decodes]
        if batch.input_rows is not None:
            # Async scheduling: the inputs are the step before's sampled tokens, on the device;
            # the ids stage the row of each in them (ModelRunner.execute gathers), and every
            # row samples (scheduler.schedule_after schedules nothing else).
            ids = batch.input_rows
            logits.sample_rows.extend(range(nd))
            logits.sample_seqs.extend(decodes)
        else:
            ids = [s.token_ids[p] for s, p in zip(decodes, pos)]
            for row, (seq, p) in enumerate(zip(decodes, pos)):
                if p + 1 == len(seq.token_ids):
                    logits.sample_rows.append(row)
                    logits.sample_seqs.append(seq)
                if seq.needs_prompt_logprobs:
                    _want_prompt_logprobs(logits, seq, row, p, 1)
        decode_lens = np.asarray(pos, dtype=np.int32) + 1
    # Prefill rows.
    row = nd * m
    kv_rows, prefill_slots_map, prefill_ids, prefill_pos = [], [], [], []
    for seq, n in zip(batch.prefills, batch.num_new_tokens):
        p = seq.num_computed_tokens
        prefill_ids.extend(seq.token_ids[p : p + n])
        prefill_pos.extend(range(p, p + n))
        table = seq.block_table_array()
        prefill_slots_map.append(_rows(table, p, p + n, block_size))
        kv_rows.append(_rows(table, 0, p + n, block_size))
        _want_logits(logits, seq, row, p, n)
        row += n
    flat_slots = np.asarray(slots_map, dtype=np.int64)
    if prefill_slots_map:
        flat_slots = np.concatenate([flat_slots, *prefill_slots_map])
    return HostStep(
        input_ids=_concat(ids, prefill_ids),
        positions=_concat(pos, prefill_pos),
        slot_mapping=flat_slots,
        num_decodes=nd,
        decode_state_indices=np.asarray([s.state_slot for s in decodes], dtype=np.int32),
        decode_tables=tables,
        decode_width=decode_width or _eager_width(tables),
        decode_context_lens=decode_lens,
        prefill_query_lens=list(batch.num_new_tokens),
        prefill_context_lens=[s.num_computed_tokens + n for s, n in zip(batch.prefills, batch.num_new_tokens)],
        prefill_state_indices=np.asarray([s.state_slot for s in batch.prefills], dtype=np.int32),
        prefill_has_initial_state=np.asarray([s.num_computed_tokens > 0 for s in batch.prefills], dtype=np.bool_),
        prefill_kv_rows=np.concatenate(kv_rows) if kv_rows else np.zeros(0, np.int64),
        logits=logits,
        tokens_per_decode=m,
        spec_state_indices=verify_slots,
        num_accepted_tokens=accepted,
        prefill_checkpoints=batch.checkpoints if batch.checkpoints and any(batch.checkpoints) else None,
        checkpoint_width=batch.checkpoint_width,
    )


def _concat(decode_part, prefill_part: list[int]) -> np.ndarray:
    if not prefill_part:
        return np.asarray(decode_part, dtype=np.int64)
    if isinstance(decode_part, list):
        return np.asarray(decode_part + prefill_part, dtype=np.int64)
    return np.concatenate([decode_part, np.asarray(prefill_part, dtype=np.int64)])


def _verify_rows(decodes: list[Sequence], m: int, block_size: int, trash_row: int, logits: LogitsRequest):
    """Rows of verify steps: per sequence its last sampled token at position p and its j drafts
    at p+1..p+j, then m-1-j padding rows (token 0 at position p, KV written to the trash row,
    context p+1) that no one ever accepts. Every row up to the last draft samples. Built as
    [N, m] arrays (a verify step of 32 sequences has 160 rows: per-row Python would cost more
    than the rest of the step's host work)."""
    N = len(decodes)
    p = np.fromiter((s.num_computed_tokens for s in decodes), dtype=np.int64, count=N)
    j = np.fromiter((len(s.draft_token_ids) for s in decodes), dtype=np.int64, count=N)
    zeros = [0] * m
    ids = np.array([[s.token_ids[s.num_computed_tokens], *s.draft_token_ids, *zeros[: m - 1 - len(s.draft_token_ids)]]
                    for s in decodes], dtype=np.int64).reshape(N, m)
    width = max((len(s.block_table) for s in decodes), default=1)
    tables = np.zeros((N, width), dtype=np.int32)
    for i, seq in enumerate(decodes):
        d = seq.draft_token_ids
        bt = seq.block_table_array()
        tables[i, : bt.shape[0]] = bt
        logits.groups.append(SampleGroup(seq, len(logits.sample_rows), list(d)))
        logits.sample_rows.extend(range(i * m, i * m + len(d) + 1))
        if seq.needs_prompt_logprobs:
            _want_prompt_logprobs(logits, seq, i * m, int(p[i]), 1)
    logits.sample_seqs.extend(decodes)
    t = np.arange(m, dtype=np.int64)[None, :]
    real = t <= j[:, None]
    pos = np.where(real, p[:, None] + t, p[:, None])
    block = np.take_along_axis(tables, np.where(real, pos // block_size, 0), axis=1).astype(np.int64)
    slots = np.where(real, block * block_size + pos % block_size, trash_row)
    ctx = np.where(real, pos + 1, p[:, None] + 1).astype(np.int32)
    return ids.reshape(-1), pos.reshape(-1), slots.reshape(-1), ctx.reshape(-1), np.repeat(tables, m, axis=0)


def _eager_width(tables: list[np.ndarray] | np.ndarray) -> int:
    """Block-table width of an eager step's decode rows: the longest table, rounded up to a
    multiple of 16. The width is the row stride of the paged-attention kernel, which Triton
    specializes (1, a multiple of 16, anything else); rounded, every step shares one variant."""
    longest = tables.shape[1] if isinstance(tables, np.ndarray) else max((t.shape[0] for t in tables), default=1)
    return -(-longest // 16) * 16


def _want_logits(logits: LogitsRequest, seq: Sequence, row: int, start: int, n: int) -> None:
    """Rows [row, row+n) hold positions [start, start+n) of seq. The last one samples when it
    reaches the end of the sequence; rows that predict a prompt token not yet scored give prompt
    log-probs (the logits at position p predict token p+1)."""
    if start + n == seq.num_tokens:
        if logits.groups is not None:
            logits.groups.append(SampleGroup(seq, len(logits.sample_rows), []))
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


def gather_inputs(ids: torch.Tensor, source: torch.Tensor) -> None:
    """ids[i] = source[ids[i]], in stream order: an overlapped step's inputs, staged as rows of
    the step before's sampled tokens (on the device, never read by the host)."""
    ids.copy_(source.index_select(0, ids))


def to_device_step(step: HostStep, device: torch.device, ring: StagingRing, kda_backends: KDABackends | None) -> DeviceStep:
    """Eager path: the step's arrays packed into a buffer of `ring` under their HostStep names, one
    non-blocking copy into a fresh device buffer, and the Context built from views of it
    (step_context.build_context, as graph capture builds its own)."""
    nd, nrows = step.num_decodes, step.num_decode_tokens
    spec = step.spec_state_indices is not None
    num_prefills = len(step.prefill_query_lens)
    T = step.input_ids.shape[0]
    cu = np.zeros(num_prefills + 1, dtype=np.int32)
    np.cumsum(step.prefill_query_lens, out=cu[1:])
    rows = step.logits.sample_rows
    staged_rows = not step.logits.sample_rows_are_leading
    i64, i32 = torch.int64, torch.int32
    ck = step.prefill_checkpoints
    ck_width = max(step.checkpoint_width, checkpoint_table_width(max(len(p) for p in ck))) if ck else 0
    ck_shape = (num_prefills, ck_width) if ck else (0,)
    layout = PackedLayout([
        ("input_ids", i64, (T,)), ("positions", i64, (T,)), ("slot_mapping", i64, (T,)),
        ("prefill_kv_rows", i64, step.prefill_kv_rows.shape), ("sample_rows", i64, (len(rows) if staged_rows else 0,)),
        ("decode_state_indices", i32, (nd,)), ("decode_context_lens", i32, (nrows,)),
        ("decode_block_tables", i32, (nrows, step.decode_width)),
        ("spec_state_indices", i32, step.spec_state_indices.shape if spec else (0,)),
        ("num_accepted_tokens", i32, (nd if spec else 0,)),
        ("prefill_cu_seqlens", i32, (num_prefills + 1 if num_prefills else 0,)), ("prefill_state_indices", i32, (num_prefills,)),
        ("prefill_has_initial_state", torch.bool, (num_prefills,)),
        ("checkpoint_offsets", i32, ck_shape), ("checkpoint_slots", i32, ck_shape),
    ])
    buf, host = ring.acquire(layout.nbytes)
    h = layout.host_views(host)
    for name in ("input_ids", "positions", "slot_mapping", "prefill_kv_rows", "decode_state_indices", "decode_context_lens",
                 "prefill_state_indices", "prefill_has_initial_state"):
        h[name][:] = getattr(step, name)
    if staged_rows:
        h["sample_rows"][:] = rows
    if spec:
        h["spec_state_indices"][:] = step.spec_state_indices
        h["num_accepted_tokens"][:] = step.num_accepted_tokens
    write_block_tables(h["decode_block_tables"], step.decode_tables)
    if num_prefills:
        h["prefill_cu_seqlens"][:] = cu
    if ck:
        h["checkpoint_offsets"][:] = -1
        h["checkpoint_slots"][:] = 0
        for n, pairs in enumerate(ck):
            for j, (offset, slot) in enumerate(pairs):
                h["checkpoint_offsets"][n, j], h["checkpoint_slots"][n, j] = offset, slot
    dev = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    ring.submit(buf, dev, layout.nbytes)
    d = layout.device_views(dev)
    checkpoints = CheckpointRequests(d["checkpoint_offsets"], d["checkpoint_slots"],
                                     tuple(tuple(o for o, _ in p) for p in ck)) if ck else None
    context = build_context(d, kda_backends, num_decodes=nd, tokens_per_decode=step.tokens_per_decode,
                            prefill_query_lens=step.prefill_query_lens, prefill_context_lens=step.prefill_context_lens,
                            prefill_cu_seqlens_cpu=torch.from_numpy(cu) if num_prefills else None,
                            prefill_checkpoints=checkpoints)
    return DeviceStep(d["input_ids"], d["positions"], context, d["sample_rows"] if staged_rows else None)
