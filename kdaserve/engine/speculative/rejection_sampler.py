"""Lossless acceptance of drafts, for a whole step at once.

A sampling sequence brings rows r_0..r_j of logits: row t holds the target model's distribution
p_t after its t-th draft (row 0: after the last accepted token), and j drafts d_1..d_j, where
d_{t+1} is the draft that row t judges. A sequence without drafts (a prefill that reached its end,
a verify with nothing proposed) has one row and plain sampling.

- Greedy rows: accept d_{t+1} iff it is p_t's argmax; at the first mismatch emit the argmax. The
  output is token for token the output without speculation.
- Random rows (temperature, top-k, top-p applied to p_t exactly as the plain sampler does):
  prompt lookup proposes deterministically, so the draft distribution q_t is a point mass at
  d_{t+1} and the standard rule min(1, p_t(d)/q_t(d)) accepts with probability p_t(d); on
  rejection the token is drawn from the residual max(p_t - q_t, 0), which is p_t with d removed
  and renormalized. Then P(emit x) = p_t(d)[x = d] + (1 - p_t(d)) p_t(x)/(1 - p_t(d))[x != d]
  = p_t(x): the output distribution is the model's. After the last draft, or with none, the next
  token is drawn from p_t itself.

Everything per row is computed on the device (accept flag and the token the row emits) and read
back in one transfer; the host then walks each sequence's rows to its first rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.engine.sampler import _logprob_lists, _logprob_tensors, _top_k_top_p, to_host
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.staging import StagingRing, stage_lists
from kdaserve.engine.structured_output.bitmask import apply_grammar_masks_to_verify_rows


@dataclass
class SampleGroup:
    """One sampling sequence of a step: its rows of the logits (consecutive) and its drafts."""

    seq: Sequence
    first_row: int          # row of r_0 in the logits given to the sampler
    drafts: list[int]       # d_1..d_j (row r_t judges drafts[t])


@dataclass
class AcceptedTokens:
    seq: Sequence
    tokens: list[int]                      # accepted drafts, then the token of the first rejecting (or last) row
    logprobs: list | None                  # per token: (logprob, top-n), when the request asked for them
    num_drafts: int

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.tokens) - 1


class RejectionSampler:
    def __init__(self, device: torch.device, generator: torch.Generator):
        self.device = device
        self.generator = generator           # the plain sampler's: unseeded requests share one stream
        self.ring = StagingRing(16 << 10, torch.device(device))
        self.grammar_ring = StagingRing(64 << 10, torch.device(device))   # structured output's bitmasks

    def sample(self, logits: torch.Tensor, groups: list[SampleGroup]) -> list[AcceptedTokens]:
        """logits [R, V] fp32, the groups' rows (each group's rows consecutive, starting at its
        first_row). One host->device copy of per-row parameters, one device->host transfer."""
        R, V = logits.shape
        raw = logits   # log-probs are of the model's distribution; decisions follow the grammars
        if any(getattr(g.seq, "grammar", None) is not None for g in groups):   # (tests pass stand-in sequences)
            logits = logits.clone()
            apply_grammar_masks_to_verify_rows(logits, groups, self.grammar_ring)
        next_draft = [-1] * R
        for g in groups:
            next_draft[g.first_row : g.first_row + len(g.drafts)] = g.drafts
        want = {id(g): g.seq.params.logprobs for g in groups}
        top_n = max((n for n in want.values() if n is not None), default=None)
        if all(g.seq.params.greedy for g in groups):
            # Greedy: a row emits its argmax and accepts its draft iff they are equal, which the
            # host sees from the argmax alone: nothing to stage, one transfer.
            emit = logits.argmax(-1)
            host = to_host([emit, *(_logprob_tensors(raw, emit, top_n) if top_n is not None else [])])
            accept_h = [d == t for d, t in zip(next_draft, host[0])]
            return self._walk(groups, accept_h, host, want, top_n, R)
        params = [None] * R
        for g in groups:
            params[g.first_row : g.first_row + len(g.drafts) + 1] = [g.seq.params] * (len(g.drafts) + 1)
        greedy = [p is None or p.greedy for p in params]
        masked = any(p is not None and (p.top_k > 0 or p.top_p < 1.0) for p in params)
        staged = {"next_draft": (torch.int64, next_draft)}
        staged["temperature"] = (torch.float32, [1.0 if g else p.temperature for g, p in zip(greedy, params)])
        staged["greedy"] = (torch.bool, greedy)
        if masked:
            staged["top_k"] = (torch.int64, [min(p.top_k, V) if p is not None else 0 for p in params])
            staged["top_p"] = (torch.float32, [p.top_p if p is not None else 1.0 for p in params])
        dev = stage_lists(self.ring, logits.device, staged)
        draft = dev["next_draft"]
        has_draft = draft >= 0
        safe_draft = draft.clamp(min=0)[:, None]

        argmax = logits.argmax(-1)
        scaled = logits / dev["temperature"][:, None]
        if masked:
            scaled = _top_k_top_p(scaled, dev["top_k"], dev["top_p"])
        probs = scaled.softmax(-1)
        uniform = torch.rand(R, device=logits.device, generator=self.generator)
        race = torch.empty_like(probs).exponential_(generator=self.generator)
        self._reseed_rows(groups, greedy, uniform, race, logits.device)
        accept_random = has_draft & (uniform < probs.gather(1, safe_draft).squeeze(1))
        # The residual: p with the draft removed (rows without a draft keep p). An exact 0 from
        # the race would turn 0/0 into NaN, which argmax would pick.
        residual = probs.scatter(1, safe_draft, torch.where(has_draft[:, None], 0.0, probs.gather(1, safe_draft)))
        drawn = (residual / race.clamp_(min=1e-20)).argmax(-1)
        accept = torch.where(dev["greedy"], has_draft & (argmax == draft), accept_random)
        emit = torch.where(accept, draft, torch.where(dev["greedy"], argmax, drawn))
        host = to_host([emit, accept, *(_logprob_tensors(raw, emit, top_n) if top_n is not None else [])])
        return self._walk(groups, host[1], host[:1] + host[2:], want, top_n, R)

    @staticmethod
    def _walk(groups, accept_h, host, want, top_n, R) -> list[AcceptedTokens]:
        """Each group's tokens up to its first rejecting row. host = [emit, *log-prob lists]."""
        emit_h = host[0]
        lp_rows = _logprob_lists(*host[1:], [top_n] * R) if top_n is not None else None
        out = []
        for g in groups:
            tokens, lps = [], [] if want[id(g)] is not None else None
            for t in range(len(g.drafts) + 1):
                r = g.first_row + t
                tokens.append(int(emit_h[r]))
                if lps is not None:
                    lp, top = lp_rows[r]
                    lps.append((lp, top[: want[id(g)]]))
                if not accept_h[r]:
                    break
            out.append(AcceptedTokens(g.seq, tokens, lps, len(g.drafts)))
        return out

    def _reseed_rows(self, groups, greedy, uniform, race, device) -> None:
        """A seeded request draws its uniforms and races from its own generator, so its tokens do
        not depend on what else is in the batch."""
        for g in groups:
            seq = g.seq
            if seq.params.seed is None or greedy[g.first_row]:
                continue
            if seq.generator is None:
                seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
            rows = slice(g.first_row, g.first_row + len(g.drafts) + 1)
            uniform[rows] = torch.rand(rows.stop - rows.start, device=device, generator=seq.generator)
            race[rows].exponential_(generator=seq.generator)
