"""Sampling from fp32 logits: greedy, temperature, top-k, top-p, per-request seeds, and
log-probs (of the raw model distribution, as OpenAI-style APIs report them).

Random rows draw by the exponential race (argmax of p / E, E ~ Exp(1)), which equals sampling from
p. A seeded request draws its E from its own generator, so its tokens do not depend on what else
is in the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (logprob of the sampled token, [(token_id, logprob), ...] top-n) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs           # mass strictly ahead of each token: the first always stays
    sorted_logits = sorted_logits.masked_fill(before > top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def logprob_rows(
    logits: torch.Tensor, targets: torch.Tensor, num_top: list[int]
) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row: the log-prob of `targets[row]` and the top `num_top[row]` (id, log-prob)."""
    logp = logits.log_softmax(-1)
    chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
    n = max(num_top, default=0)
    if n:
        top_v, top_i = logp.topk(min(n, logp.shape[-1]), dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    out = []
    for r, c in enumerate(chosen):
        k = num_top[r]
        out.append((c, list(zip(top_i[r][:k], top_v[r][:k])) if k else []))
    return out


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits [N, V] fp32, one row per sequence in `seqs`."""
        N = logits.shape[0]
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        tokens = logits.argmax(-1)
        if not all(greedy):
            temp = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=logits.device)
            scaled = logits / temp[:, None]
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                # Clamped on the host: a top_k past int64 (the API allows any integer) cannot become a tensor.
                top_k = torch.tensor([min(p.top_k, logits.shape[-1]) for p in params], device=logits.device)
                top_p = torch.tensor([p.top_p for p in params], device=logits.device)
                scaled = _top_k_top_p(scaled, top_k, top_p)
            probs = scaled.softmax(-1)
            race = torch.empty_like(probs)
            seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None and not greedy[i]]
            race.exponential_(generator=self.generator)
            for i in seeded:
                seq = seqs[i]
                if seq.generator is None:
                    seq.generator = torch.Generator(device=logits.device).manual_seed(seq.params.seed)
                race[i].exponential_(generator=seq.generator)
            # An exact 0 from the race would turn 0/0 into NaN, which argmax would pick.
            drawn = (probs / race.clamp_(min=1e-20)).argmax(-1)
            tokens = torch.where(torch.tensor(greedy, device=logits.device), tokens, drawn)
        want = [p.logprobs for p in params]
        lp: list = [None] * N
        if any(w is not None for w in want):
            rows = [i for i, w in enumerate(want) if w is not None]
            idx = torch.tensor(rows, device=logits.device)
            res = logprob_rows(logits[idx], tokens[idx], [want[i] for i in rows])
            for i, r in zip(rows, res):
                lp[i] = r
        return SampleResult(tokens.tolist(), lp)
