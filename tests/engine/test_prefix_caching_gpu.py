"""Prefix caching on a GPU: flash prefill resuming from restored checkpoints, the fused decode
with CUDA graphs crossing checkpoint boundaries, fp32 `tiny` (greedy tokens and log-probs equal
those without caching). Run: pytest -q tests/engine/test_prefix_caching_gpu.py"""

import random

import pytest

from kdaserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
_rng = random.Random(5)
SYSTEM = [_rng.randrange(1, 250) for _ in range(300)]


def _llm(cache, **kw):
    return LLM("tiny", device="cuda", dtype="float32", kda_prefill_backend="flash", kda_decode_backend="fused",
               max_num_seqs=8, max_model_len=1024, enable_prefix_caching=cache, mamba_block_size=64, **kw)


def _same(a, b):
    assert a.output_token_ids == b.output_token_ids
    assert all(abs(x["logprob"] - y["logprob"]) <= 1e-3 for x, y in zip(a.logprobs, b.logprobs))


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_shared_prompt_and_chat_turns(conv_layout):
    plain, cached = _llm(False, conv_layout=conv_layout), _llm(True, conv_layout=conv_layout)
    assert cached.engine.runner.graphs is not None
    prompts = [SYSTEM + [i + 1] * (3 + i) for i in range(5)]
    cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    for a, b in zip(cached.generate(prompts[1:], GREEDY, use_tqdm=False), plain.generate(prompts[1:], GREEDY, use_tqdm=False)):
        _same(a, b)
        assert a.metrics["num_cached_tokens"] == 256
    turn = SYSTEM[:50]
    for _ in range(3):   # each answer's decode crosses checkpoints the next turn resumes from
        a = cached.generate([turn], GREEDY, use_tqdm=False)[0]
        _same(a, plain.generate([turn], GREEDY, use_tqdm=False)[0])
        turn = turn + a.output_token_ids + [7, 8, 9]
    assert a.metrics["num_cached_tokens"] > 50
    s = cached.engine.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0
