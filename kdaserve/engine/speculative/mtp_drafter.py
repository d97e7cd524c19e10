"""The MTP drafter (speculative method "mtp"): after each step's target forward, the model's
multi-token-prediction layer runs over the step's rows (keeping its own attention caches filled
for every computed position) and drafts each sampling sequence's next verify; `MtpProposer` holds
the drafts until then.

Two halves, so that tensor-parallel ranks can run the layer in lock step: `plan` (rank 0, host
only: which token follows each row, which rows draft, and each further pass's rows, positions and
block tables; a small picklable DraftPlan) and `run` (every rank: the passes on the device, whose
all-reduces and vocabulary gathers meet; the greedy drafts come out alike on every rank, since the
gathered logits are)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.speculative.rejection_sampler import AcceptedTokens
from kdaserve.engine.step_inputs import HostStep
from kdaserve.layers.attention_metadata import AttentionMetadata
from kdaserve.layers.context import Context, reset_context, set_context


@dataclass
class DraftPass:
    """One further MTP pass: one row per drafting source still inside its cache rows."""
    live: list[int]                # indices into DraftPlan.rows: the sources this pass drafts for
    positions: list[int]           # each one's position (a cache row the scheduler reserved)
    slots: list[int]               # the cache slot of that position
    block_tables: torch.Tensor     # [len(live), width] int32, host


@dataclass
class DraftPlan:
    next_ids: torch.Tensor         # [rows] int64, host: the token after each row of the step (0: none)
    rows: list[int]                # the step's rows whose outputs draft (one per sampling sequence)
    passes: list[DraftPass]        # drafts 2..k
    # Rows whose next token is an image placeholder, as runs (first row, image hash, first token of
    # the image, count): they read the image's embedding from the encoder cache, not the token's.
    image_runs: list[tuple[int, bytes, int, int]] = field(default_factory=list)


class MtpDrafter:
    def __init__(self, model, *, num_spec_tokens: int, block_size: int, device, encoder_cache=None):
        self.model, self.num_spec_tokens, self.block_size, self.device = model, num_spec_tokens, block_size, device
        self.encoder_cache = encoder_cache   # image embeddings (engine/encoder_cache.py), models with a tower

    def drafts(self, batch: ScheduledBatch, step: HostStep, context: Context, positions: torch.Tensor,
               hidden: torch.Tensor, accepted: list[AcceptedTokens], ranks=None) -> list[tuple[Sequence, list[int]]]:
        """Rank 0: plan, tell the other ranks (`ranks`, tensor parallel), run, and read the drafts
        back in one host read (the step's tokens were read already)."""
        plan, sources = self.plan(batch, step, hidden.shape[0], accepted)
        if ranks is not None:
            ranks.send(("draft", plan))
        drafts, counts = self.run(plan, context, positions, hidden)
        if drafts is None:
            return []
        return [(seq, d[:n]) for seq, d, n in zip(sources, drafts.tolist(), counts)]

    def plan(self, batch: ScheduledBatch, step: HostStep, num_rows: int,
             accepted: list[AcceptedTokens]) -> tuple[DraftPlan, list[Sequence]]:
        """Row i of the MTP pass reads the target's hidden state and the token after its own (the
        next prompt token, or the token the step accepted there; padding and rejected rows read 0:
        their cache rows are rewritten before anyone reads them), under the step's attention
        metadata, so the layer's caches hold every computed position. A sampling sequence's first
        draft is the greedy token at the row of its newest token; each further draft is one more
        pass of the layer over one row per sequence, at the position after the previous pass's,
        while that position is inside the sequence's cache rows (its max_model_len ends its
        drafts). A row whose next token is an image placeholder reads that image's embedding (as
        vLLM's MTP does) where the image is in the encoder cache: every image this step used is; an
        image whose first token begins the next chunk is not yet (that row reads the placeholder's
        embedding: lossless, a less likely draft). Returns the plan and the drafting sequences, in
        the plan's row order."""
        m = step.tokens_per_decode
        by_seq = {a.seq.seq_id: a for a in accepted}
        next_ids = torch.zeros(num_rows, dtype=torch.int64)
        sources: list[tuple[Sequence, int, int]] = []   # (sequence, row, position of the row)
        for i, seq in enumerate(batch.decodes):
            toks = by_seq[seq.seq_id].tokens
            next_ids[i * m : i * m + len(toks)] = torch.tensor(toks)
            sources.append((seq, i * m + len(toks) - 1, seq.num_computed_tokens + len(toks) - 1))
        row = len(batch.decodes) * m
        image_runs = []
        in_step = {h for h, _, _ in step.images.sources} if step.images is not None else set()
        for seq, n in zip(batch.prefills, batch.num_new_tokens):
            p = seq.num_computed_tokens
            for item in seq.images:   # next tokens p+1 .. p+n inside an image this step used (cached)
                a, b = max(p + 1, item.offset), min(p + n + 1, item.end)
                if a < b and item.mm_hash in in_step:
                    image_runs.append((row + a - 1 - p, item.mm_hash, a - item.offset, b - a))
            known = seq.token_ids[p + 1 : p + n + 1]   # the prompt tokens after each row
            next_ids[row : row + len(known)] = torch.tensor(known, dtype=torch.int64)
            if len(known) < n:   # the last row of a finished prompt: the token the step sampled
                next_ids[row + n - 1] = by_seq[seq.seq_id].tokens[0]
                sources.append((seq, row + n - 1, p + n - 1))
            row += n
        passes = []
        live = list(range(len(sources)))
        for j in range(1, self.num_spec_tokens):
            live = [i for i in live if sources[i][2] + j < len(sources[i][0].block_table) * self.block_size]
            if not live:
                break
            passes.append(self._pass([sources[i][0] for i in live], [sources[i][2] + j for i in live], live))
        return DraftPlan(next_ids, [r for _, r, _ in sources], passes, image_runs), [s for s, _, _ in sources]

    def _pass(self, seqs: list[Sequence], positions: list[int], live: list[int]) -> DraftPass:
        bs = self.block_size
        tables = torch.zeros(len(seqs), max(len(s.block_table) for s in seqs), dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        slots = [s.block_table[q // bs] * bs + q % bs for s, q in zip(seqs, positions)]
        return DraftPass(live, positions, slots, tables)

    def run(self, plan: DraftPlan, context: Context, positions: torch.Tensor,
            hidden: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
        """Every rank: the MTP layer over the step's rows (every step: a prompt chunk that samples
        nothing still fills the caches), then the plan's further passes. Returns the drafts
        [sources, k] on the device (None without sources) and how many each source made."""
        images = None
        if plan.image_runs:
            cached = self.encoder_cache.embeddings
            rows = torch.cat([torch.arange(r, r + n) for r, _, _, n in plan.image_runs])
            images = (rows.to(self.device, non_blocking=True),
                      torch.cat([cached[h][a : a + n] for _, h, a, n in plan.image_runs]))
        set_context(context)
        try:
            out = self.model.draft_hidden(plan.next_ids.to(self.device, non_blocking=True), positions, hidden, images)
        finally:
            reset_context()
        if not plan.rows:
            return None, []
        h = out[torch.tensor(plan.rows, dtype=torch.int64).to(self.device, non_blocking=True)]
        # Drafts stay on the device until the end: each pass reads the previous pass's tokens there.
        drafts = torch.zeros(len(plan.rows), self.num_spec_tokens, dtype=torch.int64, device=self.device)
        drafts[:, 0] = self.model.compute_logits(h).argmax(-1)
        counts = [1] * len(plan.rows)
        live = list(range(len(plan.rows)))   # the sources `h` holds a row of, in order
        for j, p in enumerate(plan.passes, start=1):
            # Draft j+1 reads draft j, and the previous pass's output as its hidden state (vLLM's
            # recycling of the MTP output).
            if len(p.live) < len(live):
                keep = {i: k for k, i in enumerate(live)}
                h = h[torch.tensor([keep[i] for i in p.live], device=h.device)]
                live = p.live
            index = torch.tensor(live, device=self.device)
            h = self._draft_pass(p, drafts[index, j - 1], h)
            drafts[index, j] = self.model.compute_logits(h).argmax(-1)
            for i in live:
                counts[i] += 1
        return drafts, counts

    def _draft_pass(self, p: DraftPass, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One more MTP step: one row per sequence at its reserved position, reading `tokens` (on the
        device) and `hidden`, attending over the layer's cache up to and including that row, as a
        decode step does."""
        to = dict(device=self.device, non_blocking=True)
        md = AttentionMetadata(slot_mapping=torch.tensor(p.slots, dtype=torch.int64).to(**to),
                               num_decode_tokens=len(p.live), decode_block_tables=p.block_tables.to(**to),
                               decode_context_lens=torch.tensor([q + 1 for q in p.positions], dtype=torch.int32).to(**to))
        set_context(Context(attn=md))
        try:
            return self.model.draft_hidden(tokens, torch.tensor(p.positions, dtype=torch.int64).to(**to), hidden)
        finally:
            reset_context()
