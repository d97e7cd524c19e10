"""Sampling options through the engine on `tiny`, and the sampler's masks on hand-made logits."""

import math

import pytest
import torch

from kdaserve.engine import LLM, SamplingParams
from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.sampler import Sampler, _top_k_top_p
from kdaserve.engine.sequence import Sequence
from kdaserve.models.tokenizer import ByteTokenizer

PROMPTS = ["Once upon a time", "In a galaxy far away", "Sampling"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", max_num_seqs=8, max_model_len=128, kda_prefill_backend="reference", kda_decode_backend="reference")


def _ids(outs):
    return [o.output_token_ids for o in outs]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    batched = _ids(llm.generate(PROMPTS, p, use_tqdm=False))
    alone = [_ids(llm.generate([x], p, use_tqdm=False))[0] for x in PROMPTS]
    assert batched == alone
    other_seed = _ids(llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True),
                                   use_tqdm=False))
    assert other_seed != batched
    greedy = _ids(llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False))
    assert batched != greedy


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = _ids(llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False))
    topk1 = _ids(llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=2.0, top_k=1, ignore_eos=True), use_tqdm=False))
    topp = _ids(llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=2.0, top_p=1e-6, seed=3, ignore_eos=True),
                             use_tqdm=False))
    assert topk1 == greedy == topp


def test_stop_token_ids_and_stop_strings(llm):
    full = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stop_tok = full.output_token_ids[5]
    first = full.output_token_ids.index(stop_tok)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.output_token_ids == full.output_token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(full.output_token_ids[:first])   # the stop token's text is left out

    text = full.text
    stop = text[3:5] if len(text) >= 5 else text[-1]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]


def test_eos_stops_unless_ignored(llm, monkeypatch):
    full = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    eos = full.output_token_ids[4]     # pretend this token is the model's EOS
    monkeypatch.setattr(llm.engine.output, "eos_token_id", eos)
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10), use_tqdm=False)[0]
    first = full.output_token_ids.index(eos)
    assert out.finish_reason == "stop" and out.output_token_ids == full.output_token_ids[: first + 1]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert out.output_token_ids == full.output_token_ids and out.finish_reason == "length"


def test_max_model_len_ends_generation(llm):
    ids = [65] * 120
    out = llm.generate([ids], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 128 - 120


def test_logprobs_of_sampled_and_top_tokens(llm):
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.output_token_ids, out.logprobs):
        assert lp["token_id"] == tok and len(lp["top"]) == 3
        assert lp["top"][0][0] == tok and math.isclose(lp["top"][0][1], lp["logprob"], rel_tol=1e-6)   # greedy
        vals = [v for _, v in lp["top"]]
        assert vals == sorted(vals, reverse=True) and all(v <= 0 for v in vals)
    zero = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2, logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    assert all(lp["top"] == [] for lp in zero.logprobs)
    assert llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].logprobs is None


def test_prompt_logprobs_match_a_direct_forward(llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    small = LLM("tiny", max_num_seqs=2, max_model_len=128, max_num_batched_tokens=4,
                kda_prefill_backend="reference", kda_decode_backend="reference")
    chunked = small.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i, (a, b) in enumerate(zip(out.prompt_logprobs[1:], chunked.prompt_logprobs[1:]), start=1):
        assert a["token_id"] == ids[i] == b["token_id"] and len(a["top"]) == 2
        assert math.isclose(a["logprob"], b["logprob"], rel_tol=1e-4, abs_tol=1e-4)
        assert a["logprob"] <= a["top"][0][1] + 1e-6


def test_masks_keep_top_k_and_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    masked = _top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.7]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(masked[1]).tolist() == [True, True, False, False]   # 0.5 + 0.3 >= 0.7


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    seq = Sequence("x", [1], SamplingParams(temperature=1.0), IncrementalDetokenizer(ByteTokenizer(), []))
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = probs.log().expand(4000, 4).contiguous()
    tokens = torch.tensor(sampler.sample(logits, [seq] * 4000).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03) and freq[3] == 0


def test_a_top_k_past_the_vocabulary_is_no_top_k():
    # The API lets any integer through; a top_k past int64 once raised inside the step (torch.tensor
    # overflow) and so failed every request of that step.
    logits = torch.randn(2, 8)

    def draw(top_k):
        seq = Sequence("x", [1], SamplingParams(temperature=1.0, top_k=top_k, top_p=0.9, seed=7),
                       IncrementalDetokenizer(ByteTokenizer(), []))
        return Sampler(torch.device("cpu"), seed=0).sample(logits, [seq, seq]).token_ids

    assert draw(2**63) == draw(2**40) == draw(0)


def test_prompt_logprobs_take_logits_a_few_rows_at_a_time(llm, monkeypatch):
    # Scoring a long prompt (lm-eval's echo + logprobs) must not build [prompt tokens, vocab] fp32
    # logits at once: with a real vocabulary that is gigabytes the memory profile never reserved
    # (it reserves logits for max_num_seqs rows).
    ids = [65 + i % 26 for i in range(40)]
    want = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0].prompt_logprobs
    model, rows_seen = llm.engine.runner.model, []
    real = model.compute_logits

    def counting(hidden):
        rows_seen.append(hidden.shape[0])
        return real(hidden)

    monkeypatch.setattr(model, "compute_logits", counting)
    got = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0].prompt_logprobs
    assert max(rows_seen) <= llm.engine.config.max_num_seqs, rows_seen
    assert got == want


def test_a_vanishing_temperature_samples_the_argmax():
    # logits / 1e-320 overflow to inf, the softmax to NaN, and argmax then picked token 0.
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    for t in (1e-6, 1e-39, 1e-320):
        seq = Sequence("x", [1], SamplingParams(temperature=t), IncrementalDetokenizer(ByteTokenizer(), []))
        assert Sampler(torch.device("cpu"), seed=0).sample(logits, [seq]).token_ids == [1], t


def test_only_plain_greedy_batches_take_the_argmax_shortcut():
    """Sampler.sample answers a batch of plain greedy rows with the argmax alone; a greedy row
    whose logits something changes (min_tokens holding the end token back, a logit bias) or that
    wants log-probs must still go the whole way."""
    tok = ByteTokenizer()
    eos = tok.eos_token_id
    logits = torch.full((3, tok.vocab_size), -5.0)
    logits[:, eos] = 5.0
    logits[:, 7] = 4.0

    def seq(**kw):
        return Sequence("x", [1], SamplingParams(**kw), IncrementalDetokenizer(tok, []))

    sampler = Sampler(torch.device("cpu"), seed=0, stop_ids=frozenset({eos}))
    plain = [seq(), seq(), seq()]
    assert all(s.plain_greedy for s in plain)
    assert sampler.sample(logits, plain).token_ids == [eos] * 3
    held = [seq(), seq(min_tokens=3), seq(logit_bias={9: 100.0})]
    assert not any(s.plain_greedy for s in held[1:])
    assert sampler.sample(logits, held).token_ids == [eos, 7, 9]
    scored = sampler.sample(logits, [seq(), seq(logprobs=1), seq()])
    assert scored.token_ids == [eos] * 3 and scored.logprobs[1] is not None and scored.logprobs[0] is None
