"""`adaptive` decode: exactly `fused` up to its head-step limits (plain decode: none by default;
speculative verify: FUSED_MAX_VERIFY_HEAD_STEPS), exactly `chain` above (bit for bit: the same
kernels run)."""

import pytest
import torch

import kdaserve.ops.kda.adaptive as adaptive
from kdaserve.ops.kda.adaptive import kda_decode_adaptive, uses_fused
from kdaserve.ops.kda.chain import kda_decode_chain
from kdaserve.ops.kda.fused import kda_decode_fused
from kdaserve.testing import make_kda_case, tolerance_for
from kdaserve.testing.properties import check_decode_matches_reference, run_decode, with_fused_decode_layout

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(lens, seed, **kw):
    return with_fused_decode_layout(make_kda_case(lens, H=2, D=16, seed=seed, device=DEV, **kw))


def _run_all(case, **kw):
    """(output, recurrent pool, conv pool) of adaptive, fused and chain, each on its own copy."""
    res = {}
    for name, fn in (("adaptive", kda_decode_adaptive), ("fused", kda_decode_fused), ("chain", kda_decode_chain)):
        c = case.clone()
        c.weights.conv_weight_decode = case.weights.conv_weight_decode
        out = run_decode(fn, c, **kw)
        res[name] = (out, c.recurrent_state, c.conv_state)
    return res


def _same(a, b) -> bool:
    return all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))


def test_threshold_counts_sequences_heads_and_tokens(monkeypatch):
    assert uses_fused(1, 32) and uses_fused(4096, 64)  # plain decode: fused at every size by default
    assert uses_fused(4, 32, tokens_per_sequence=4) and not uses_fused(8, 32, tokens_per_sequence=4)
    assert uses_fused(1, 128, tokens_per_sequence=4) and not uses_fused(1, 129, tokens_per_sequence=4)
    assert not uses_fused(1, 513, verify=True), "a verify without drafts (1 token) takes the verify limit"
    monkeypatch.setattr(adaptive, "FUSED_MAX_HEAD_STEPS", 512)
    assert uses_fused(16, 32) and not uses_fused(17, 32)
    assert uses_fused(1, 512) and not uses_fused(1, 513)


@pytest.mark.parametrize("limit, expect", [(10**6, "fused"), (0, "chain")])
def test_runs_exactly_the_chosen_backend(monkeypatch, limit, expect):
    monkeypatch.setattr(adaptive, "FUSED_MAX_HEAD_STEPS", limit)
    case = _case([1] * 3, seed=4, slow_decay_heads=1)
    case.state_indices[1] = 0  # a padding row
    res = _run_all(case)
    other = "chain" if expect == "fused" else "fused"
    assert _same(res["adaptive"], res[expect])
    assert not _same(res["adaptive"], res[other]), "fused and chain round differently: the test could not tell them apart"


# limit 6 = sequences x heads: a verify of 3 tokens per sequence is 18 head-steps, so chain.
@pytest.mark.parametrize("limit, expect", [(10**6, "fused"), (0, "chain"), (6, "chain"), (18, "fused")])
def test_speculative_verify_runs_the_chosen_backend(monkeypatch, limit, expect):
    monkeypatch.setattr(adaptive, "FUSED_MAX_VERIFY_HEAD_STEPS", limit)
    S, N = 2, 3
    case = _case([S + 1] * N, seed=5, spec_tokens=S, extra_slots=N * (S + 1) + 2)
    free = [s for s in range(1, case.recurrent_state.shape[0]) if s not in set(case.state_indices.tolist())]
    spec = torch.tensor(free[: N * (S + 1)], dtype=torch.int32, device=DEV).view(N, S + 1)
    accepted = torch.tensor([1, 3, 2], dtype=torch.int32, device=DEV)
    res = _run_all(case, spec_state_indices=spec, num_accepted_tokens=accepted)
    assert _same(res["adaptive"], res[expect])


def test_default_threshold_matches_reference():
    """Small and large plain decode steps against the fp64 reference (2 heads: 3 and 300 sequences)."""
    for n in (3, 300):
        check_decode_matches_reference(kda_decode_adaptive, _case([1] * n, seed=6 + n), tolerance_for(torch.float32))
