"""Continuous batching with chunked prefill under a token budget.

Every running request asks for its uncomputed tokens: one for a decode, a chunk for a prefill.
Running requests go first (oldest first), then waiting ones are admitted while the budget, a free
state slot and KV blocks allow. A step may mix decodes and prefills. When KV blocks run out, the
newest running request is preempted by recompute: its slot and blocks return to the pools and it
re-enters the front of the queue to prefill its prompt and outputs again (the state is rebuilt
from scratch, so nothing stale can leak in).

With speculative decoding (S > 0) every decode is a verify step of S+1 tokens (the last sampled
token and up to S drafts, padded to S), which costs S+1 tokens of the budget and KV blocks for
its real drafts; a request holds S+1 state slots (engine/speculative says why).

With the MTP drafter a step that samples also reserves cache rows for the `lookahead` positions
after its newest token (the drafter's further passes write there), up to max_model_len.

With prefix caching (engine/prefix_cache) an admitted request may start past a cached prefix,
prefill chunks take the checkpoints they cross inside the step (or, for backends that cannot, end
at them), and a request waits while a running one prefills the prefix they share."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kdaserve.engine.block_manager import BlockManager
from kdaserve.engine.prefix_cache.disabled import NoPrefixCache
from kdaserve.engine.sequence import Sequence, SequenceStatus
from kdaserve.engine.state_pool import StateSlotPool
from kdaserve.ops.kda.types import checkpoint_table_width


@dataclass
class ScheduledBatch:
    """One step's work. Decodes (one token each, with history; with `spec_tokens` S > 0, verifies
    of S+1 tokens each) come first in the step, then prefill chunks; `num_new_tokens[i]` goes with
    `prefills[i]`."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    spec_tokens: int = 0
    # Prefix-cache hits: (checkpoint slot, request's slot) state copies to run before the forward.
    restores: list[tuple[int, int]] = field(default_factory=list)
    # Prefix-cache checkpoints the prefill writes inside its launch: per prefill, (offset, slot)s,
    # staged `checkpoint_width` wide (fixed per engine: one compiled kernel variant).
    checkpoints: list[list[tuple[int, int]]] | None = None
    checkpoint_width: int = 0
    # Async scheduling (schedule_after): the decodes' input tokens are the step before's sampled
    # tokens, still on the device; decode i reads row input_rows[i] of them. None: from token_ids.
    input_rows: list[int] | None = None

    @property
    def tokens_per_decode(self) -> int:
        return self.spec_tokens + 1

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) * self.tokens_per_decode + sum(self.num_new_tokens)

    @property
    def sequences(self) -> list[Sequence]:
        return self.decodes + self.prefills

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, slots: StateSlotPool, blocks: BlockManager,
                 num_spec_tokens: int = 0, prefix_cache=None, lookahead: int = 0, max_model_len: int | None = None):
        self.spec = num_spec_tokens
        self.lookahead, self.max_model_len = lookahead, max_model_len
        self.prefix = prefix_cache if prefix_cache is not None else NoPrefixCache()   # engine/prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slots, self.blocks = slots, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        batch.spec_tokens = self.spec
        self.prefix.begin_step()
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            verify = self.spec and seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens > 0
            if verify:
                n = self.spec + 1
                kv_tokens = self._kv_end(seq, seq.num_computed_tokens + 1 + len(seq.draft_token_ids), samples=True)
            else:
                n = self.prefix.chunk_len(seq, min(seq.num_uncomputed_tokens, budget))
                kv_tokens = self._kv_end(seq, seq.num_computed_tokens + n)
            # With speculation a decode is a whole verify, and a 1-token chunk with history would
            # be one: both wait for a step with budget left.
            if n > budget or (self.spec and not verify and n == 1 and seq.num_computed_tokens > 0):
                break
            need = self.blocks.extra_blocks_for(seq, kv_tokens)
            while need > self.blocks.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                if need:   # a new block every block_size tokens: most decode steps need none
                    self.blocks.grow(seq, kv_tokens)
                self._add_to_batch(batch, seq, n, verify)
                budget -= n
                i += 1
                continue
            break
        # Admit waiting requests, oldest first, unless memory just ran short.
        while self.waiting and budget > 0 and not batch.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.slots.num_free < self.spec + 1:
                break
            if self.prefix.should_wait(seq, self.running):
                break   # a running request is computing this prefix: resume from it in a later step
            hit = self.prefix.find(seq)
            skip, shared = (hit.num_tokens, hit.blocks) if hit else (0, [])
            n = min(seq.num_tokens - skip, budget)
            if self.spec and skip and n == 1:   # it would be a verify: wait for a step with budget left
                break
            # The hit's blocks that no one holds count as free until sharing takes them.
            need = (self.blocks.blocks_needed(self._kv_end(seq, skip + n)) - len(shared)
                    + self.blocks.num_evictable_in(shared))
            if need > self.blocks.num_free:
                break
            self.waiting.popleft()
            self.prefix.count_query(seq, hit)
            self.slots.assign(seq, self.spec)
            if hit:
                batch.restores.append(self.prefix.apply(seq, hit))
            n = self.prefix.chunk_len(seq, n)
            self.blocks.grow(seq, self._kv_end(seq, seq.num_computed_tokens + n))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, n, False)
            budget -= n
        if self.prefix.in_step and batch.prefills:
            batch.checkpoints = [self.prefix.step_checkpoints(s, n) for s, n in zip(batch.prefills, batch.num_new_tokens)]
            # A step takes at most the per-request cap per sequence (the cap drops the rest first).
            batch.checkpoint_width = checkpoint_table_width(self.prefix.per_request)
        return batch

    def schedule_after(self, sampling: list[Sequence]) -> ScheduledBatch | None:
        """The next step while the current one is still running (async scheduling): every
        running request decodes the token the current step samples for it, which only the device
        knows yet (`sampling`: the current step's sampling sequences, in its sample order). None
        where that step needs more than such a decode batch: a request that may be admitted (one
        waits, and a slot and a block are free), a running request the current step does not
        sample for, KV blocks short (preemption), the token budget exceeded, speculative
        decoding or the drafter's lookahead. Requests that the current
        step's token ends by length (max_tokens, max_model_len) are left out; those it ends
        otherwise (a stop token or string, an abort) decode once more for nothing, and the
        engine drops that token."""
        if self.spec or self.lookahead or not self.running:
            return None
        admissible = len(self.running) < self.max_num_seqs and self.slots.num_free > self.spec and self.blocks.num_free
        if self.waiting and admissible:
            return None
        row_of = {id(s): i for i, s in enumerate(sampling)}
        decodes, rows, growing = [], [], []
        need = 0
        max_len = self.max_model_len if self.max_model_len is not None else float("inf")
        block_size = self.blocks.block_size
        # Once per running request and step: the sequence's fields read once (the properties
        # each take a len(); ~64 requests per step add up on the engine's host time).
        for seq in self.running:
            row = row_of.get(id(seq))
            n = len(seq.token_ids)
            computed = seq.num_computed_tokens
            if row is None or n != computed:
                return None
            # After the current step's token: n + 1 tokens, num_output_tokens + 1 outputs.
            if n - seq.num_prompt_tokens + 1 >= seq.params.max_tokens or n + 1 >= max_len:
                continue
            decodes.append(seq)
            rows.append(row)
            if computed + 1 > len(seq.block_table) * block_size:   # its next KV row starts a block
                growing.append(seq)
                need += self.blocks.extra_blocks_for(seq, computed + 1)
        if not decodes or len(decodes) > self.max_num_batched_tokens:
            return None
        if need > self.blocks.num_free:
            return None
        for seq in growing:
            self.blocks.grow(seq, seq.num_computed_tokens + 1)
        return ScheduledBatch(decodes=decodes, input_rows=rows)

    def _kv_end(self, seq: Sequence, end: int, samples: bool = False) -> int:
        """Cache rows `seq` needs for a step computing its tokens up to `end`: with the lookahead
        when the step samples (a verify, or a chunk reaching the sequence's end), up to max_model_len."""
        if not self.lookahead or not (samples or end == seq.num_tokens):
            return end
        cap = self.max_model_len if self.max_model_len is not None else end + self.lookahead
        return max(end, min(end + self.lookahead, cap))

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, seq: Sequence, n: int, verify: bool) -> None:
        # One token with history is a decode for the KDA layers (conv update + recurrence),
        # whether it was sampled or is the last token of a prompt chunked to its end.
        if verify or (n == 1 and seq.num_computed_tokens > 0):
            batch.decodes.append(seq)
        else:
            batch.prefills.append(seq)
            batch.num_new_tokens.append(n)

    def _release(self, seq: Sequence) -> None:
        self.slots.release(seq)
        seq.draft_token_ids = []
        self.blocks.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a request (finished or aborted) and return its slot and blocks to the pools."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
