"""Sampling from fp32 logits: greedy, temperature, top-k, top-p, per-request seeds, and
log-probs (of the raw model distribution, as OpenAI-style APIs report them).

Random rows draw by the exponential race (argmax of p / E, E ~ Exp(1)), which equals sampling from
p. A seeded request draws its E from its own generator, so its tokens do not depend on what else
is in the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.engine.logits_processors import apply_logits_processors, apply_min_p
from kdaserve.engine.readback import ReadbackRing
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.staging import StagingRing, stage_lists
from kdaserve.engine.structured_output.bitmask import apply_grammar_masks


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
) -> list[tuple[float, list[tuple[int, float]], int]]:
    """For each row: the log-prob of `targets[row]`, the top `num_top[row]` (id, log-prob) and the
    target's rank (1 = the most likely; vLLM's prompt log-probs report it)."""
    dev = _logprob_tensors(logits, targets, max(num_top, default=0))
    ranks = (logits > logits.gather(1, targets[:, None])).sum(-1) + 1
    *host, rank = to_host([*dev, ranks])
    return [(lp, top, int(r)) for (lp, top), r in zip(_logprob_lists(*host, num_top), rank)]


def _logprob_tensors(logits: torch.Tensor, targets: torch.Tensor, n: int) -> list[torch.Tensor]:
    """[chosen log-prob [R], top-n log-probs [R, n], their ids [R, n]], on the device."""
    logp = logits.log_softmax(-1)
    chosen = logp.gather(1, targets[:, None]).squeeze(1)
    top_v, top_i = logp.topk(min(n, logp.shape[-1]), dim=-1)
    return [chosen, top_v, top_i]


def _logprob_lists(chosen: list, top_v: list, top_i: list, num_top: list[int]) -> list:
    width = len(top_v) // max(len(chosen), 1)
    out = []
    for r, c in enumerate(chosen):
        k = min(num_top[r], width)
        ids = top_i[r * width : r * width + k]
        vals = top_v[r * width : r * width + k]
        out.append((c, [(int(i), v) for i, v in zip(ids, vals)]))
    return out


class PendingSample:
    """A step's sampled tokens (and log-probs) on their way to the host. `tokens` is the device
    tensor at once: an overlapped next step reads its inputs from it (engine/llm_engine.py,
    async scheduling). `token_ids` and `logprobs` are host lists on first read, which waits for
    the one device->host copy started behind the sampling (into a buffer of `ring`,
    engine/readback.py) -- not for the whole stream, so work queued after the sampling (the next
    step) keeps running while the host reads them."""

    def __init__(self, tokens: torch.Tensor, ring: ReadbackRing, lp_parts: list[torch.Tensor] | None = None,
                 lp_rows: list[int] = (), num_top: list[int] = ()):
        self.tokens = tokens
        self._lp_rows, self._num_top = list(lp_rows), list(num_top)
        parts = [tokens, *(lp_parts or [])]
        self._sizes = [t.numel() for t in parts]
        self._result: SampleResult | None = None
        # One transfer for everything: float64 holds fp32 values and token ids (< 2**53) exactly.
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in parts]) if lp_parts else tokens.reshape(-1)
        self._host, self._event = ring.start(self, flat)

    def result(self) -> SampleResult:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            tokens, *host = _split(self._host.tolist(), self._sizes)
            lp: list = [None] * len(tokens)
            if self._lp_rows:
                for i, r in zip(self._lp_rows, _logprob_lists(*host, self._num_top)):
                    lp[i] = r
            self._result = SampleResult([int(t) for t in tokens], lp)
        return self._result

    @property
    def token_ids(self) -> list[int]:
        return self.result().token_ids

    @property
    def logprobs(self) -> list:
        return self.result().logprobs


def to_host(tensors: list[torch.Tensor]) -> list[list]:
    """Each tensor as a flat host list, in ONE device->host transfer (each .tolist() is a sync):
    all go through float64, exact for fp32 values and for integers below 2**53 (token ids)."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    return _split(flat, [t.numel() for t in tensors])


def _split(flat: list, sizes: list[int]) -> list[list]:
    """`flat` cut into consecutive lists of `sizes` elements (tensors sent in one transfer)."""
    out, at = [], 0
    for size in sizes:
        out.append(flat[at : at + size])
        at += size
    return out


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, stop_ids: frozenset[int] = frozenset()):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.ring = StagingRing(4 << 10, torch.device(device))   # per-row parameters, one copy a step
        self.processor_ring = StagingRing(4 << 10, torch.device(device))   # logits processors' (row, token) pairs
        self.grammar_ring = StagingRing(64 << 10, torch.device(device))    # grammar bitmasks (structured output)
        self.readback = ReadbackRing(torch.device(device))   # each step's sampled tokens to the host
        self.stop_ids = stop_ids   # the model's end-of-sequence ids, which min_tokens holds back

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """logits [N, V] fp32, one row per sequence in `seqs`. One host->device copy of the rows'
        parameters (none when every row is greedy and all or no rows want log-probs) and one
        device->host transfer of the results, which the caller waits for only when it reads them
        (PendingSample)."""
        if all([s.plain_greedy for s in seqs]):   # serving's common batch: what the path below gives it
            return PendingSample(logits.argmax(-1), self.readback)
        N, V = logits.shape
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        random = not all(greedy)
        masked = random and any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        min_p = random and any(p.min_p > 0 for p in params)
        want = [p.logprobs for p in params]
        lp_rows = [i for i, w in enumerate(want) if w is not None]
        some_lp = 0 < len(lp_rows) < N
        staged = {}
        if random:
            staged["temperature"] = (torch.float32, [1.0 if g else p.temperature for g, p in zip(greedy, params)])
            staged["greedy"] = (torch.bool, greedy)
        if masked:
            # Clamped on the host: a top_k past int64 (the API allows any integer) fits no tensor.
            staged["top_k"] = (torch.int64, [min(p.top_k, V) for p in params])
            staged["top_p"] = (torch.float32, [p.top_p for p in params])
        if min_p:
            staged["min_p"] = (torch.float32, [p.min_p for p in params])
        if some_lp:
            staged["logprob_rows"] = (torch.int64, lp_rows)
        dev = stage_lists(self.ring, logits.device, staged) if staged else {}

        # Log-probs are of the raw distribution: the processors work on a copy.
        processed = logits
        if any(p.has_logits_processors for p in params):
            processed = apply_logits_processors(logits.clone(), seqs, self.stop_ids, self.processor_ring)
        if any(s.grammar is not None for s in seqs):
            processed = processed.clone() if processed is logits else processed
            apply_grammar_masks(processed, seqs, self.grammar_ring)
        tokens = processed.argmax(-1)
        if random:
            scaled = processed / dev["temperature"][:, None]
            if masked:
                scaled = _top_k_top_p(scaled, dev["top_k"], dev["top_p"])
            probs = scaled.softmax(-1)
            if min_p:
                probs = apply_min_p(probs, dev["min_p"])
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
            tokens = torch.where(dev["greedy"], tokens, drawn)
        if not lp_rows:
            return PendingSample(tokens, self.readback)
        idx = dev["logprob_rows"] if some_lp else slice(None)
        parts = _logprob_tensors(logits[idx], tokens[idx], max(want[i] for i in lp_rows))
        return PendingSample(tokens, self.readback, parts, lp_rows, [want[i] for i in lp_rows])
