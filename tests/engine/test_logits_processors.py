"""min_tokens, logit_bias, the penalties and min_p: exact math of each processor on given logits,
and each one changing the engine's output the way it should (CPU, `tiny`, reference backends)."""

import math
from types import SimpleNamespace

import pytest
import torch

from kdaserve.engine import LLM, SamplingParams
from kdaserve.engine.logits_processors import apply_logits_processors, apply_min_p
from kdaserve.engine.staging import StagingRing

CPU = torch.device("cpu")


def _seq(tokens, num_prompt, **params):
    p = SamplingParams(max_tokens=64, **params)
    return SimpleNamespace(params=p, token_ids=list(tokens), output_token_ids=list(tokens[num_prompt:]),
                           num_output_tokens=len(tokens) - num_prompt)


def test_each_processor_on_given_logits():
    V = 8
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 4.0]] * 5)
    seqs = [
        _seq([1, 2, 3, 3, 5], 2, repetition_penalty=2.0),                 # prompt 1 2, outputs 3 3 5
        _seq([1, 2, 3, 3, 5], 2, presence_penalty=0.5, frequency_penalty=0.25),
        _seq([1, 2, 3], 2, logit_bias={6: 10.0, 0: -1.5}),
        _seq([1, 2, 3], 2, min_tokens=3, stop_token_ids=[5], ignore_eos=False),   # 1 output < 3
        _seq([1, 2], 2),                                                   # no processor: untouched
    ]
    out = apply_logits_processors(logits.clone(), seqs, frozenset({7}), StagingRing(64, CPU))
    want = logits.clone()
    for t in (1, 2, 3, 5):                                   # prompt and output tokens
        want[0, t] = want[0, t] / 2 if want[0, t] > 0 else want[0, t] * 2
    want[1, 3] -= 0.25 * 2 + 0.5                              # output counts: 3 twice, 5 once
    want[1, 5] -= 0.25 * 1 + 0.5
    want[2, 6] += 10.0
    want[2, 0] -= 1.5
    want[3, 5] = want[3, 7] = -math.inf                       # the stop token and EOS held back
    assert torch.equal(out, want)
    assert V == logits.shape[1]


def test_min_p_keeps_tokens_near_the_most_likely():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    got = apply_min_p(probs, torch.tensor([0.5, 0.0]))
    assert torch.equal(got, torch.tensor([[0.5, 0.3, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]))


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference", max_model_len=128)


PROMPT = [[10, 20, 30, 40, 50]]


def _out(llm, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("ignore_eos", True)
    return llm.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0]


def test_logit_bias_forces_and_forbids_tokens(llm):
    assert _out(llm, logit_bias={77: 100}).output_token_ids == [77] * 8
    plain = _out(llm).output_token_ids
    banned = _out(llm, logit_bias={t: -100 for t in set(plain)}).output_token_ids
    assert not set(banned) & set(plain)


def test_min_tokens_holds_back_stop_tokens(llm):
    # Token 77 is forced and is a stop token: without min_tokens the request ends at once.
    assert _out(llm, logit_bias={77: 100}, stop_token_ids=[77]).output_token_ids == [77]
    out = _out(llm, logit_bias={77: 100}, stop_token_ids=[77], min_tokens=3)
    assert out.output_token_ids[:3] != [77] * 3 and 77 not in out.output_token_ids[:3]
    assert out.output_token_ids[3] == 77 and out.num_output_tokens == 4 and out.finish_reason == "stop"


def test_penalties_break_a_forced_repetition(llm):
    # The smallest bias (in steps of 1) that makes 77 every greedy token of 16: then a frequency
    # penalty of 2 per occurrence, or a repetition penalty (the biased logit divided by 100),
    # takes it back before the end. (The presence penalty's math is checked above: once past the
    # margin a bias leaves, it changes nothing more.)
    bias = next(b for b in range(1, 200) if _out(llm, max_tokens=16, logit_bias={77: b}).output_token_ids == [77] * 16)
    freq = _out(llm, max_tokens=16, logit_bias={77: bias}, frequency_penalty=2.0).output_token_ids
    assert 0 < freq.count(77) < 16, (bias, freq)
    rep = _out(llm, max_tokens=16, logit_bias={77: bias}, repetition_penalty=100.0).output_token_ids
    assert rep.count(77) < 16, (bias, rep)


def test_min_p_one_samples_the_argmax(llm):
    greedy = _out(llm).output_token_ids
    assert _out(llm, temperature=1.0, min_p=1.0, seed=1).output_token_ids == greedy


def test_bad_values_say_what_is_expected():
    for kw, msg in (({"presence_penalty": 3}, r"presence_penalty: got 3; expected a number in \[-2.0, 2.0\]"),
                    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
                    ({"min_tokens": 99, "max_tokens": 4}, r"min_tokens: got 99; expected an integer in \[0, max_tokens=4\]"),
                    ({"logit_bias": {"x": 1}}, "logit_bias")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)
    llm = LLM("tiny", device="cpu", max_model_len=64, speculative_config={"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        llm.generate(PROMPT, SamplingParams(min_p=0.1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"invalid logit_bias token 999999; expected ids in \[0, 260\)"):
        llm.generate(PROMPT, SamplingParams(logit_bias={999999: 1}), use_tqdm=False)
