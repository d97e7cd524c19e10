"""The sampler's staged parameters and single device->host transfer give exactly what the sampler
gave before them (kept below, verbatim, as the reference): tokens, log-probs and top lists, seeded
and unseeded rows, greedy, temperature, top-k and top-p, log-probs for all, some or no rows."""

import random

import pytest
import torch

from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.sampler import Sampler, _top_k_top_p
from kdaserve.engine.sampling_params import SamplingParams
from kdaserve.engine.sequence import Sequence
from kdaserve.models.tokenizer import ByteTokenizer


# ---- the sampler before staging (commit 46a8b6a), as the reference ----------------------------
def _old_logprob_rows(
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


class OldSampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) :
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
            res = _old_logprob_rows(logits[idx], tokens[idx], [want[i] for i in rows])
            for i, r in zip(rows, res):
                lp[i] = r
        return (tokens.tolist(), lp)


# ---- tests ------------------------------------------------------------------------------------

def _params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "temp", "topk", "topp", "seeded", "seeded-topk"])
    kw = dict(logprobs=rng.choice([None, None, 0, 1, 3]))
    if kind != "greedy":
        kw["temperature"] = rng.choice([0.5, 1.0, 1.7])
    if kind in ("topk", "seeded-topk"):
        kw["top_k"] = rng.choice([1, 3, 40, 2**63])
    if kind == "topp":
        kw["top_p"] = rng.choice([0.3, 0.9])
    if kind.startswith("seeded"):
        kw["seed"] = rng.randrange(2**32)
    return SamplingParams(**kw)


def _seqs(params):
    return [Sequence(f"r{i}", [1], p, IncrementalDetokenizer(ByteTokenizer(), [])) for i, p in enumerate(params)]


@pytest.mark.parametrize("case", range(12))
def test_staged_sampler_equals_the_sampler_before(case):
    rng = random.Random(case)
    N = rng.choice([1, 3, 8]) if case < 10 else 64     # 64 rows: a temperature off by 2% shows
    if case == 0:
        params = [SamplingParams() for _ in range(N)]                       # all greedy: nothing staged
    elif case == 1:
        params = [SamplingParams(logprobs=2) for _ in range(N)]             # all rows want log-probs
    else:
        params = [_params(rng) for _ in range(N)]
    new, old = Sampler(torch.device("cpu"), seed=case), OldSampler(torch.device("cpu"), seed=case)
    new_seqs, old_seqs = _seqs(params), _seqs(params)
    for _ in range(3):      # several steps: generators (global and per request) advance alike
        logits = torch.randn(N, 50) * 3
        got = new.sample(logits, new_seqs)
        want_tokens, want_lp = old.sample(logits, old_seqs)
        assert got.token_ids == want_tokens and all(type(t) is int for t in got.token_ids)
        assert got.logprobs == want_lp
        for entry in got.logprobs:
            if entry is not None:
                assert type(entry[0]) is float and all(type(i) is int and type(v) is float for i, v in entry[1])
