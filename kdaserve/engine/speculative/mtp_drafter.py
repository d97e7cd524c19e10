"""The MTP drafter (speculative method "mtp"): after each step's target forward, the model's
multi-token-prediction layer runs over the step's rows (keeping its own attention caches filled
for every computed position) and drafts each sampling sequence's next verify; `MtpProposer` holds
the drafts until then."""

from __future__ import annotations

import torch

from kdaserve.engine.scheduler import ScheduledBatch
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.speculative.rejection_sampler import AcceptedTokens
from kdaserve.engine.step_inputs import HostStep
from kdaserve.layers.attention_metadata import AttentionMetadata
from kdaserve.layers.context import Context, reset_context, set_context


class MtpDrafter:
    def __init__(self, model, *, num_spec_tokens: int, block_size: int, device):
        self.model, self.num_spec_tokens, self.block_size, self.device = model, num_spec_tokens, block_size, device

    def drafts(self, batch: ScheduledBatch, step: HostStep, context: Context, positions: torch.Tensor, hidden: torch.Tensor,
                    accepted: list[AcceptedTokens]) -> list[tuple[Sequence, list[int]]]:
        """The MTP layer over every row of the step (models/glm5_next_mtp.py): row i reads the
        target's hidden state and the token after its own (the next prompt token, or the token
        the step accepted there; padding and rejected rows read 0: their cache rows are
        rewritten before anyone reads them), under the step's attention metadata, so the layer's
        caches hold every computed position. A sampling sequence's first draft is the greedy
        token at the row of its newest token; each further draft is one more pass of the layer
        over one row per sequence (_draft_pass). One host read for all the drafts (the step's
        tokens were read already)."""
        m = step.tokens_per_decode
        by_seq = {a.seq.seq_id: a for a in accepted}
        next_ids = torch.zeros(hidden.shape[0], dtype=torch.int64)
        sources: list[tuple[Sequence, int, int]] = []   # (sequence, row, position of the row)
        for i, seq in enumerate(batch.decodes):
            toks = by_seq[seq.seq_id].tokens
            next_ids[i * m : i * m + len(toks)] = torch.tensor(toks)
            sources.append((seq, i * m + len(toks) - 1, seq.num_computed_tokens + len(toks) - 1))
        row = len(batch.decodes) * m
        for seq, n in zip(batch.prefills, batch.num_new_tokens):
            p = seq.num_computed_tokens
            known = seq.token_ids[p + 1 : p + n + 1]   # the prompt tokens after each row
            next_ids[row : row + len(known)] = torch.tensor(known, dtype=torch.int64)
            if len(known) < n:   # the last row of a finished prompt: the token the step sampled
                next_ids[row + n - 1] = by_seq[seq.seq_id].tokens[0]
                sources.append((seq, row + n - 1, p + n - 1))
            row += n
        set_context(context)   # every step: a prompt chunk that samples nothing still fills the caches
        try:
            out = self.model.draft_hidden(next_ids.to(self.device, non_blocking=True), positions, hidden)
        finally:
            reset_context()
        if not sources:
            return []
        rows = torch.tensor([r for _, r, _ in sources], dtype=torch.int64).to(self.device, non_blocking=True)
        h = out[rows]
        # Drafts stay on the device until the end: each pass reads the previous pass's tokens there,
        # and one host read returns them all.
        drafts = torch.zeros(len(sources), self.num_spec_tokens, dtype=torch.int64, device=self.device)
        drafts[:, 0] = self.model.compute_logits(h).argmax(-1)
        counts = [1] * len(sources)
        live = list(range(len(sources)))   # the sources `h` holds a row of, in order
        for j in range(1, self.num_spec_tokens):
            # Draft j+1 reads draft j at the position after the previous pass's, and that pass's
            # output as its hidden state (vLLM's recycling of the MTP output). Positions past the
            # cache rows a sequence holds (its max_model_len) end its drafts.
            keep = [k for k, i in enumerate(live) if sources[i][2] + j < len(sources[i][0].block_table) * self.block_size]
            if not keep:
                break
            if len(keep) < len(live):
                h = h[torch.tensor(keep, device=h.device)]
                live = [live[k] for k in keep]
            index = torch.tensor(live, device=self.device)
            h = self._draft_pass([sources[i][0] for i in live], [sources[i][2] + j for i in live],
                                     drafts[index, j - 1], h)
            drafts[index, j] = self.model.compute_logits(h).argmax(-1)
            for i in live:
                counts[i] += 1
        return [(seq, d[:n]) for (seq, _, _), d, n in zip(sources, drafts.tolist(), counts)]

    def _draft_pass(self, seqs: list[Sequence], positions: list[int], tokens: torch.Tensor,
                        hidden: torch.Tensor) -> torch.Tensor:
        """One more MTP step: per sequence one row at `positions[i]` (a cache row the scheduler
        reserved: EngineConfig's MTP lookahead) reading `tokens[i]` (on the device) and `hidden[i]`, attending
        over the layer's cache up to and including that row, as a decode step does."""
        bs = self.block_size
        width = max(len(s.block_table) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        slots = [s.block_table[q // bs] * bs + q % bs for s, q in zip(seqs, positions)]
        to = dict(device=self.device, non_blocking=True)
        md = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64).to(**to), num_decode_tokens=len(seqs),
                               decode_block_tables=tables.to(**to),
                               decode_context_lens=torch.tensor([q + 1 for q in positions], dtype=torch.int32).to(**to))
        set_context(Context(attn=md))
        try:
            return self.model.draft_hidden(tokens, torch.tensor(positions, dtype=torch.int64).to(**to), hidden)
        finally:
            reset_context()
