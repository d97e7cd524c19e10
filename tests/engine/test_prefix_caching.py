"""Prefix caching on the `tiny` hybrid (CPU, reference backends): outputs and prompt log-probs equal
those without caching in every situation the issue lists, a restored state equals the state
computed from scratch, the counts of computed tokens drop by exactly the cached amount, and every
slot and block returns to its pool."""

from __future__ import annotations

import random

import pytest
import torch

from kdaserve.engine import LLM, SamplingParams

C = 32            # checkpoint interval (mamba_block_size): 2 KV blocks of 16
# logprobs=0: each sampled token's log-prob, compared too (a stale state can leave greedy tokens
# unchanged on a random model, never its log-probs).
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
_rng = random.Random(3)
SYSTEM = [_rng.randrange(1, 250) for _ in range(150)]


def _llm(cache: bool, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    kw.setdefault("max_num_seqs", 8)
    if cache:
        kw.setdefault("mamba_block_size", C)
    return LLM("tiny", device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference",
               enable_prefix_caching=cache, **kw)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _llm(False)


class _Out(list):
    """Output tokens that compare equal only if their log-probs (when reported) agree too."""

    def __init__(self, out):
        super().__init__(out.output_token_ids)
        self.lps = [e["logprob"] for e in out.logprobs] if out.logprobs is not None else None

    def __eq__(self, other):
        if list(self) != list(other):
            return False
        if isinstance(other, _Out) and self.lps is not None and other.lps is not None:
            return all(abs(a - b) <= 1e-4 for a, b in zip(self.lps, other.lps))
        return True


def _ids(llm, prompts, params=GREEDY):
    return [_Out(o) for o in llm.generate(prompts, params, use_tqdm=False)]


def _drained(llm) -> None:
    s = llm.engine.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0, s
    assert llm.engine.blocks.num_free == llm.engine.blocks.capacity, "every block free or evictable"


def _user(i: int) -> list[int]:
    return [(7 * i + j) % 250 + 1 for j in range(5 + i)]


def test_shared_system_prompt(plain):
    llm = _llm(True)
    prompts = [SYSTEM + _user(i) for i in range(4)]
    want = _ids(plain, prompts)
    assert _ids(llm, prompts[:1]) == want[:1]
    before = llm.engine.counters["prompt_tokens"]
    assert _ids(llm, prompts[1:]) == want[1:]
    s = llm.engine.stats()
    hit = len(SYSTEM) // C * C
    assert s["prefix_cache_hits"] == 3 * hit
    # Counting: the three later prompts computed exactly their tokens minus the cached ones.
    assert llm.engine.counters["prompt_tokens"] - before == sum(len(p) for p in prompts[1:]) - 3 * hit
    _drained(llm)


def test_prompt_logprobs_and_sampled_tokens_match(plain):
    llm = _llm(True)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [SYSTEM + _user(i) for i in range(3)]
    llm.generate(prompts[:1], params, use_tqdm=False)
    got = llm.generate(prompts[1:], params, use_tqdm=False)
    want = plain.generate(prompts[1:], params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.output_token_ids == w.output_token_ids
        for a, b in zip(g.logprobs, w.logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    scored = llm.generate([prompts[1]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ref = plain.generate([prompts[1]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert scored.metrics["num_cached_tokens"] == 0, "prompt log-probs need every prompt token computed"
    assert [e and e["top"][0][0] for e in scored.prompt_logprobs] == [e and e["top"][0][0] for e in ref.prompt_logprobs]


def test_multi_turn_chat_reuses_the_answer(plain):
    """Turn 2 = turn 1's prompt + its answer + a new message: the answer's decode crossed
    checkpoint boundaries, so turn 2 resumes past the first turn's prompt."""
    llm = _llm(True)
    turn1 = SYSTEM[:40]
    answer = _ids(llm, [turn1], SamplingParams(max_tokens=70, ignore_eos=True))[0]
    assert answer == _ids(plain, [turn1], SamplingParams(max_tokens=70, ignore_eos=True))[0]
    turn2 = turn1 + list(answer) + _user(2)
    out = llm.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert _Out(out) == _ids(plain, [turn2])[0]
    assert out.metrics["num_cached_tokens"] == (len(turn1) + len(answer)) // C * C > len(turn1)
    _drained(llm)


def test_prompts_that_diverge_inside_a_block(plain):
    """`a` (100 tokens, one chunk) leaves checkpoints at 32, 64 and 96, written by the prefill
    itself (the reference backend takes them inside the step). A prompt that leaves it inside the
    block after 96 resumes at 96; one that leaves it at 70 resumes at 64."""
    llm = _llm(True)
    a = SYSTEM[:100]
    late = SYSTEM[:99] + [251] + SYSTEM[100:110]
    early = SYSTEM[:70] + [251] + SYSTEM[71:100]
    assert _ids(llm, [a]) == _ids(plain, [a])
    for b, cached in ((late, 96), (early, 64)):
        out = llm.generate([b], GREEDY, use_tqdm=False)[0]
        assert _Out(out) == _ids(plain, [b])[0]
        assert out.metrics["num_cached_tokens"] == cached


def test_prefix_longer_than_the_step_budget(plain):
    llm = _llm(True, max_num_batched_tokens=40)
    prompts = [SYSTEM + _user(i) for i in range(2)]
    assert _ids(llm, prompts[:1]) == _ids(plain, prompts[:1])
    assert _ids(llm, prompts[1:]) == _ids(plain, prompts[1:])
    assert llm.engine.stats()["prefix_cache_hits"] == len(SYSTEM) // C * C
    _drained(llm)


def test_n_samples_and_seeds(plain):
    llm = _llm(True)
    prompt = SYSTEM + _user(1)
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    llm.generate([prompt], params[:1], use_tqdm=False)
    got = [o.output_token_ids for o in llm.generate([prompt] * 4, params, use_tqdm=False)]
    want = [o.output_token_ids for o in plain.generate([prompt] * 4, params, use_tqdm=False)]
    assert got == want
    _drained(llm)


def test_preemption_and_abort_in_the_middle(plain):
    prompts = [SYSTEM[:64] + _user(i) for i in range(4)]
    want = _ids(plain, prompts)
    tight = _llm(True, num_kv_blocks=10, max_model_len=96)
    tight.generate(prompts[:1], GREEDY, use_tqdm=False)
    eng = tight.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    eng.add_request("gone", SYSTEM[:64] + [9, 9], GREEDY)
    outs = {}
    step = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
        if step == 3:
            eng.abort_request("gone")
    assert eng.counters["preemptions"] > 0, "the pool is small enough to preempt"
    assert [_Out(outs[f"r{i}"]) for i in range(4)] == want
    assert outs["gone"].finish_reason == "abort"
    assert eng.stats()["prefix_cache_hits"] > 0
    _drained(tight)


def test_restored_state_equals_the_state_from_scratch():
    llm = _llm(True)
    prompt = SYSTEM[:100]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    pc = llm.engine.prefix_cache
    key = pc.hasher.extend([], prompt)[C * 3 // 16 - 1]
    slot = pc.checkpoints.lookup(key)
    assert slot is not None, "a checkpoint at 96"
    fresh = _llm(False, max_num_seqs=1)
    fresh.generate([prompt[:96]], SamplingParams(max_tokens=1), use_tqdm=False)   # its slot 1 keeps the state after 96
    for (conv, rec), (conv_f, rec_f) in zip(llm.engine.runner.caches.kda, fresh.engine.runner.caches.kda):
        torch.testing.assert_close(conv[slot], conv_f[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rec[slot], rec_f[1], rtol=1e-5, atol=1e-5)


def test_eviction_keeps_results_and_returns_everything():
    """One checkpoint slot and a small block pool: prefixes evict each other, hits fall back to
    recomputation, results stay those of plain decoding."""
    plain = _llm(False, max_model_len=128)
    llm = _llm(True, max_model_len=128, prefix_cache_states=1, num_kv_blocks=20)
    prompts = [[k + 1] * 20 + SYSTEM[:50] + _user(k) for k in range(3)] * 2
    for p in prompts:
        assert _ids(llm, [p]) == _ids(plain, [p])
    s = llm.engine.stats()
    assert s["prefix_cache_states"] == 1 and s["prefix_cache_hits"] < s["prefix_cache_queries"]
    _drained(llm)
    assert llm.engine.reset_prefix_cache() and llm.engine.stats()["prefix_cache_blocks"] == 0


def test_speculation_leaves_no_rejected_draft_in_the_cache(plain):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = _llm(True, speculative_config=spec)
    turn1 = SYSTEM[:40] + SYSTEM[:40]   # repetitive: prompt lookup drafts, some rejected
    answer = _ids(llm, [turn1], SamplingParams(max_tokens=60, ignore_eos=True))[0]
    assert answer == _ids(plain, [turn1], SamplingParams(max_tokens=60, ignore_eos=True))[0]
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] > llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    turn2 = turn1 + list(answer) + _user(3)
    assert _ids(llm, [turn2]) == _ids(plain, [turn2])
    _drained(llm)


@pytest.mark.parametrize("kw, message", [
    ({"mamba_block_size": 24}, "multiple of block_size=16"),
    ({"prefix_caching_hash_algo": "md5"}, "unknown --prefix-caching-hash-algo"),
    ({"prefix_caching_hash_algo": "sha256_cbor"}, "not supported here"),
    ({"prefix_cache_states": -1}, "prefix_cache_states"),
])
def test_bad_settings_say_what_is_expected(kw, message):
    from kdaserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", enable_prefix_caching=True, **kw)


def test_flags_follow_vllm():
    import argparse

    from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args

    p = add_engine_args(argparse.ArgumentParser())
    assert engine_kwargs_from_args(p.parse_args(["--enable-prefix-caching"]))["enable_prefix_caching"] is True
    assert engine_kwargs_from_args(p.parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
    args = engine_kwargs_from_args(p.parse_args(["--prefix-caching-hash-algo", "xxhash", "--mamba-block-size", "64"]))
    assert args["prefix_caching_hash_algo"] == "xxhash" and args["mamba_block_size"] == 64


def test_kimi_linear_mla_latent_cache_and_moe_with_a_hit():
    """Kimi-Linear's MLA latent blocks are shared like KV blocks; KDA with the unbounded gate resumes
    from a restored checkpoint."""
    kw = dict(device="cpu", max_model_len=256, max_num_seqs=4, mamba_block_size=32)
    plain = LLM("kimi-tiny", enable_prefix_caching=False, **kw)
    cached = LLM("kimi-tiny", enable_prefix_caching=True, **kw)
    prompts = [SYSTEM[:70] + _user(i) for i in range(3)]
    cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    got = cached.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [_Out(o) for o in got] == _ids(plain, prompts[1:])
    assert [o.metrics["num_cached_tokens"] for o in got] == [64, 64]
    _drained(cached)


def test_a_cache_salt_keeps_prefixes_apart():
    """(Checkpoint slots for the three tenants' 4 each: none evicts another's.)"""
    llm = _llm(True, prefix_cache_states=12)
    prompt = SYSTEM + _user(1)
    salted = lambda salt: SamplingParams(max_tokens=2, ignore_eos=True, cache_salt=salt)  # noqa: E731
    llm.generate([prompt], salted("tenant-a"), use_tqdm=False)
    assert llm.generate([prompt], salted("tenant-b"), use_tqdm=False)[0].metrics["num_cached_tokens"] == 0
    assert llm.generate([prompt], salted(None), use_tqdm=False)[0].metrics["num_cached_tokens"] == 0
    assert llm.generate([prompt], salted("tenant-a"), use_tqdm=False)[0].metrics["num_cached_tokens"] > 0
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_a_long_answer_keeps_the_shared_prefix_checkpoint(plain):
    """Past its cap (2 here) a request keeps the checkpoint ending its prompt's last interval and
    its newest: the shared system prompt stays reusable after a long answer, and so does the
    answer's end."""
    llm = _llm(True, prefix_cache_states_per_request=2)
    system = SYSTEM[:64]
    first = llm.generate([system + _user(0)], SamplingParams(max_tokens=150, ignore_eos=True), use_tqdm=False)[0]
    assert len(llm.engine.prefix_cache.checkpoints._lru) == 2
    out = llm.generate([system + _user(1)], GREEDY, use_tqdm=False)[0]
    assert out.metrics["num_cached_tokens"] == 64 and _Out(out) == _ids(plain, [system + _user(1)])[0]
    turn2 = system + _user(0) + first.output_token_ids + _user(2)
    out = llm.generate([turn2], GREEDY, use_tqdm=False)[0]
    # The first request computed 69 + 149 tokens: its newest checkpoint is at 192.
    assert out.metrics["num_cached_tokens"] == 192


def test_a_cap_of_one_keeps_the_newest():
    llm = _llm(True, prefix_cache_states_per_request=1)
    llm.generate([SYSTEM[:64] + _user(0)], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert len(llm.engine.prefix_cache.checkpoints._lru) == 1
    _drained(llm)


def test_samples_of_one_prompt_share_its_prefill(plain):
    """Four samples of one long prompt: the first computes it, the others wait for its last shared
    checkpoint and compute only the rest; an unrelated request behind them is not held up for long."""
    llm = _llm(True)
    prompt = SYSTEM + _user(0)
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=s, ignore_eos=True, logprobs=0) for s in range(4)]
    other = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([prompt] * 4 + [_user(7)], params + [other], use_tqdm=False)
    want = plain.generate([prompt] * 4 + [_user(7)], params + [other], use_tqdm=False)
    assert [_Out(o) for o in outs] == [_Out(o) for o in want]
    hit = (len(prompt) - 1) // C * C
    assert [o.metrics["num_cached_tokens"] for o in outs[:4]] == [0, hit, hit, hit]
    assert llm.engine.counters["prompt_tokens"] == len(prompt) + 3 * (len(prompt) - hit) + len(_user(7))
    _drained(llm)
