"""Speculative decoding in the engine (CPU, reference backends): lossless outputs, no trace of a
rejected draft in any cache, every slot and block back in its pool, and the acceptance rule's
distribution (engine/speculative)."""

import json
import random

import numpy as np
import pytest
import torch
from scipy import stats

from kdaserve.engine import LLM, LLMEngine, SamplingParams
from kdaserve.engine.args import add_engine_args
from kdaserve.engine.speculative import SpeculativeConfig
from kdaserve.engine.speculative.ngram_proposer import NgramProposer, TokenHistory, propose_ngram
from kdaserve.engine.speculative.rejection_sampler import RejectionSampler, SampleGroup
from kdaserve.ops.kda.types import conv_state_rows
from kdaserve.testing.speculative import ScriptedProposer

S = 3
CLOSE = dict(rtol=1e-5, atol=1e-5)
NGRAM = {"method": "ngram", "num_speculative_tokens": S, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
_rng = random.Random(7)
REPEAT = [5, 6, 7, 8, 9, 10, 11, 12] * 5
PROMPTS = [REPEAT, [_rng.randrange(250) for _ in range(23)], REPEAT[:13] + [3] * 9, [42], [17, 17, 17, 17]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _llm(spec=None, **kw) -> LLM:
    kw.setdefault("max_model_len", 128)
    return LLM("tiny", device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference", max_num_seqs=8,
               speculative_config=spec, **kw)


def _ids(llm, prompts=PROMPTS, params=GREEDY):
    return [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _no_leaks(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0, s


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _llm()


@pytest.fixture(scope="module")
def want(plain) -> list[list[int]]:
    return _ids(plain)


def _scripted(llm: LLM, want, wrong) -> ScriptedProposer:
    llm.engine.proposer = ScriptedProposer({tuple(p): w for p, w in zip(PROMPTS, want)}, S, wrong)
    return llm.engine.proposer


# ---------------------------------------------------------------- lossless outputs


def test_ngram_speculation_gives_the_tokens_of_plain_decoding(want):
    llm = _llm(NGRAM)
    assert _ids(llm) == want
    s = llm.engine.stats()
    assert s["spec_decode_num_draft_tokens"] > 0 and s["spec_decode_num_accepted_tokens"] > 0, s
    assert s["spec_decode_num_draft_tokens"] > s["spec_decode_num_accepted_tokens"], "some drafts must be rejected"
    _no_leaks(llm)


def test_each_request_reports_its_own_acceptance(want):
    """Per-request speculative metrics (vLLM's `metrics.speculative_decoding`): consistent in
    themselves, and summing over the requests to the engine's counters."""
    llm = _llm(NGRAM)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    reported = [o.metrics["spec_decode"] for o in outs if "spec_decode" in o.metrics]
    assert reported, "some requests had drafts"
    for m in reported:
        h = m["acceptance_histogram"]
        assert len(h) == S + 1 and sum(h) == m["num_spec_steps"] and m["num_spec_tokens"] == S
        assert m["num_accepted_draft_tokens"] == sum(j * n for j, n in enumerate(h)) <= m["num_draft_tokens"]
        assert m["mean_acceptance_length"] == 1 + m["num_accepted_draft_tokens"] / m["num_spec_steps"]
    assert sum(m["num_draft_tokens"] for m in reported) == stats["spec_decode_num_draft_tokens"]
    assert sum(m["num_accepted_draft_tokens"] for m in reported) == stats["spec_decode_num_accepted_tokens"]
    assert sum(m["num_spec_steps"] for m in reported) == stats["spec_decode_num_drafts"]


def test_every_acceptance_length_with_chunked_prefill(want):
    """Scripted drafts wrong at position 0, 1, 2 or nowhere, in turn: every number of accepted
    drafts occurs, in steps that mix verifies with prefill chunks (budget of 7 tokens)."""
    llm = _llm(NGRAM, max_num_batched_tokens=7)
    _scripted(llm, want, lambda call: [0, 1, 2, None][call % 4])
    assert _ids(llm) == want
    per_pos = llm.engine.stats()["spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[0] > per_pos[1] > per_pos[2] > 0, per_pos
    _no_leaks(llm)


def test_right_drafts_take_fewer_steps(plain, want):
    llm = _llm(NGRAM)
    _scripted(llm, want, lambda call: None)
    before = plain.engine.counters["steps"]
    _ids(plain)
    plain_steps = plain.engine.counters["steps"] - before
    assert _ids(llm) == want
    s = llm.engine.stats()
    assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
    assert s["steps"] * 3 < plain_steps * 2, (s["steps"], plain_steps)


def test_preempted_verifying_requests_resume_with_the_same_tokens(want):
    tight = _llm(NGRAM, num_kv_blocks=9)
    _scripted(tight, want, lambda call: [1, None, 0][call % 3])
    outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tight.engine.counters["preemptions"] > 0
    assert [o.output_token_ids for o in outs] == want
    _no_leaks(tight)


def test_requests_that_finish_inside_a_draft_window(plain, want):
    """max_tokens and a stop token reached at an accepted draft: the request ends there, the
    drafts after it are dropped, and its slots and blocks go back."""
    llm = _llm(NGRAM)
    _scripted(llm, want, lambda call: None)
    short = SamplingParams(max_tokens=6, ignore_eos=True)
    assert _ids(llm, params=short) == [w[:6] for w in want]
    stop = want[0][4]
    params = SamplingParams(max_tokens=24, stop_token_ids=[stop], ignore_eos=True)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.output_token_ids for o in got] == _ids(plain, params=params)
    assert got[0].output_token_ids[-1] == stop and got[0].finish_reason == "stop"
    _no_leaks(llm)


def test_logprobs_and_seeded_sampling_with_speculation(plain):
    llm = _llm(NGRAM)
    lp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    a, b = plain.generate(PROMPTS[:3], lp, use_tqdm=False), llm.generate(PROMPTS[:3], lp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.output_token_ids == y.output_token_ids
        for u, v in zip(x.logprobs, y.logprobs):
            assert u["token_id"] == v["token_id"] and abs(u["logprob"] - v["logprob"]) < 1e-4
            assert [t for t, _ in u["top"]] == [t for t, _ in v["top"]]
    seeded = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
    assert _ids(llm, PROMPTS[:2], seeded) == _ids(llm, PROMPTS[:2], seeded), "a seeded request repeats itself"
    _no_leaks(llm)


# ---------------------------------------------------------------- no trace in the caches


def test_a_rejected_draft_leaves_no_trace_in_any_cache(want):
    """After verify steps that rejected drafts, every cache of the sequence equals, state by state,
    that of plain decoding at the same number of computed tokens: the KDA recurrent state (in the
    slot the next step resumes from), the conv window, and the KV rows of every computed position.
    Equal up to fp32 rounding (the projections see other row counts); a draft's trace is O(0.1)."""
    # Caches are compared between steps: no step may still be in flight (async scheduling).
    plain_eng = LLMEngine("tiny", device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference",
                          max_model_len=128, max_num_seqs=2, async_scheduling=False)
    spec_eng = LLMEngine("tiny", device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference",
                         max_model_len=128, max_num_seqs=2, speculative_config=NGRAM)
    spec_eng.proposer = ScriptedProposer({tuple(PROMPTS[0]): want[0]}, S, lambda call: [1, 0, 2][call % 3])
    for eng in (plain_eng, spec_eng):
        eng.add_request("r", PROMPTS[0], GREEDY)
    sp, pl = spec_eng.requests["r"], plain_eng.requests["r"]
    W = spec_eng.runner.model.kda_layers[0].conv_width
    checked = 0
    for _ in range(5):
        spec_eng.step()
        if sp.num_computed_tokens == sp.num_prompt_tokens:
            continue                       # the prefill step: no verify yet
        while pl.num_computed_tokens < sp.num_computed_tokens:
            plain_eng.step()
        assert pl.num_computed_tokens == sp.num_computed_tokens and pl.token_ids == sp.token_ids
        a, c = sp.num_accepted, sp.num_computed_tokens
        assert a <= S, "scripted drafts are wrong somewhere in every step"
        layout = spec_eng.config.conv_layout
        for (conv_s, rec_s), (conv_p, rec_p) in zip(spec_eng.runner.caches.kda, plain_eng.runner.caches.kda):
            torch.testing.assert_close(rec_s[sp.verify_slots[a - 1]], rec_p[pl.state_slot], **CLOSE)
            window = conv_state_rows(conv_s, layout)[sp.state_slot][a - 1 : a - 1 + W - 1]
            torch.testing.assert_close(window, conv_state_rows(conv_p, layout)[pl.state_slot][-(W - 1):], **CLOSE)
        bs = spec_eng.config.block_size
        rows = lambda seq: [seq.block_table[q // bs] * bs + q % bs for q in range(c)]   # noqa: E731
        for kv_s, kv_p in zip(spec_eng.runner.caches.kv, plain_eng.runner.caches.kv):
            for t_s, t_p in zip(kv_s, kv_p):
                flat_s, flat_p = t_s.flatten(0, 1), t_p.flatten(0, 1)
                torch.testing.assert_close(flat_s[rows(sp)], flat_p[rows(pl)], **CLOSE)
        checked += 1
    assert checked >= 3


# ---------------------------------------------------------------- the acceptance rule


def _first_two(sampler_cls, p0, p1, draft, trials, seed=0):
    """Sample `trials` verifies of one draft over logits rows (p0, p1): the emitted first token, and
    the second when the draft was accepted (else -1)."""
    V = p0.shape[0]
    logits = torch.stack([p0.log(), p1.log()]).repeat(trials, 1)
    params = SamplingParams(temperature=1.0)

    class Seq:
        def __init__(self):
            self.params, self.generator = params, None

    groups = [SampleGroup(Seq(), 2 * i, [draft]) for i in range(trials)]
    sampler = sampler_cls(torch.device("cpu"), torch.Generator().manual_seed(seed))
    out = sampler.sample(logits, groups)
    first = np.array([a.tokens[0] for a in out])
    second = np.array([a.tokens[1] if len(a.tokens) > 1 else -1 for a in out])
    assert V > 0
    return first, second


def _fit(first, second, p0, p1, draft) -> float:
    """Chi-square p-value of the observed (first, second-after-accept) counts against the model's
    law: first ~ p0; given first == draft, second ~ p1."""
    V = p0.shape[0]
    n = len(first)
    observed = np.concatenate([np.bincount(first[first != draft], minlength=V)[[v for v in range(V) if v != draft]],
                               np.bincount(second[first == draft], minlength=V)])
    expected = np.concatenate([n * p0.numpy()[[v for v in range(V) if v != draft]], n * p0[draft].item() * p1.numpy()])
    return stats.chisquare(observed, expected).pvalue


P0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10], dtype=torch.float64).float()
P1 = torch.tensor([0.40, 0.05, 0.15, 0.10, 0.20, 0.10], dtype=torch.float64).float()


@pytest.mark.parametrize("draft", [1, 0])   # a likely draft and an unlikely one
def test_sampled_tokens_keep_the_models_distribution(draft):
    first, second = _first_two(RejectionSampler, P0, P1, draft, trials=20000)
    assert _fit(first, second, P0, P1, draft) > 1e-3


class AcceptAlways(RejectionSampler):
    """A wrong rule (accepting every draft), to show the check above can fail."""

    def sample(self, logits, groups):
        out = super().sample(logits, groups)
        for a, g in zip(out, groups):
            if a.tokens[0] != g.drafts[0]:
                a.tokens = [g.drafts[0], a.tokens[0]]
        return out


def test_the_distribution_check_fails_a_wrong_rule():
    first, second = _first_two(AcceptAlways, P0, P1, 1, trials=20000)
    assert _fit(first, second, P0, P1, 1) < 1e-6


# ---------------------------------------------------------------- drafts and configuration


def test_prompt_lookup_takes_the_longest_most_recent_match():
    t = np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    assert propose_ngram(t, 1, 3, 3) == [4, 5, 9]
    assert propose_ngram(t, 4, 5, 3) == []                       # no 4-gram recurs
    assert propose_ngram(np.array([5, 6, 5, 6, 5]), 2, 4, 2) == [6, 5]
    assert propose_ngram(np.array([1, 2, 8, 1, 2, 9, 1, 2]), 2, 2, 1) == [9]   # the most recent of equal lengths
    assert propose_ngram(np.array([3]), 1, 1, 4) == []
    history, tokens = TokenHistory(), []
    for k in range(600):                                         # grows past its first buffer
        tokens.append(k % 7)
        assert history.sync(tokens).tolist() == tokens
    proposer = NgramProposer(4, 1, 3)

    class Seq:
        seq_id, token_ids = 0, [1, 2, 3, 1, 2]

    assert proposer.propose(Seq(), room=2) == [3, 1] and proposer.propose(Seq(), room=0) == []


@pytest.mark.parametrize("value, message", [
    ("{not json", "not JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle'"),
    ('{"num_speculative_tokens": 0}', r"num_speculative_tokens: got 0"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min=4 > prompt_lookup_max=2"),
    ('{"num_speculative_tokens": 2, "draft_model": "x"}', "unknown keys"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_speculative_configs_say_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_flag_and_defaults_follow_vllm():
    import argparse

    args = add_engine_args(argparse.ArgumentParser()).parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert SpeculativeConfig.parse(args.speculative_config) == SpeculativeConfig("ngram", S, 1, 3)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}) == SpeculativeConfig("ngram", 2, 5, 5)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 3}).prompt_lookup_min == 3
    with pytest.raises(ValueError, match="num_speculative_tokens \\+ 1 = 4 tokens must fit"):
        _llm(NGRAM, max_num_batched_tokens=3)


def test_a_verifying_request_holds_s_plus_1_state_slots(want):
    llm = _llm(NGRAM)
    assert llm.engine.slots.capacity == 8 * (S + 1)
    eng = llm.engine
    eng.add_request("a", PROMPTS[0], GREEDY)
    eng.step()
    seq = eng.requests["a"]
    assert len(set(seq.verify_slots)) == S + 1 and eng.slots.num_used == S + 1 and seq.num_accepted == S + 1
    eng.abort_request("a")
    eng.step()
    _no_leaks(llm)


def test_kimi_linear_mla_latent_cache_and_moe_under_speculation():
    """Kimi-Linear's MLA layers keep a latent cache: verify rows write it at every draft position
    and read it causally, so rejected drafts must not change the tokens either."""
    kw = dict(device="cpu", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16)
    prompts, params = PROMPTS[:3], SamplingParams(max_tokens=16, ignore_eos=True)
    plain = _ids(LLM("kimi-tiny", **kw), prompts, params)
    llm = LLM("kimi-tiny", speculative_config=NGRAM, **kw)
    llm.engine.proposer = ScriptedProposer({tuple(p): w for p, w in zip(prompts, plain)}, S,
                                           lambda call: [2, 0, None, 1][call % 4])
    assert _ids(llm, prompts, params) == plain
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    _no_leaks(llm)
