"""The engine with our Triton KDA backends, on the CPU through the Triton interpreter (CI sets
TRITON_INTERPRET=1): same greedy tokens as the reference backends, chunked prefill included."""

import os

import pytest

from kdaserve.backends import BackendUnavailableError
from kdaserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")

PROMPTS = ["Hello", "The quick brown fox jumps", "KDA"]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def _gen(prefill, decode, **kw):
    try:
        llm = LLM("tiny", max_num_seqs=4, max_model_len=64, kda_prefill_backend=prefill, kda_decode_backend=decode, **kw)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    return [o.output_token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("prefill, decode", [("reference", "chain"), ("reference", "fused"), ("flash", "chain")])
def test_triton_backends_in_the_engine_match_the_reference(prefill, decode):
    want = _gen("reference", "reference")
    assert _gen(prefill, decode, max_num_batched_tokens=12) == want


def test_speculative_verify_through_the_triton_kernels():
    """Verify steps through flash prefill and the fused verify kernel (interpreted): the tokens of
    plain decoding with the reference backends, with prompt-lookup drafts on a repeating prompt."""
    prompts = [[5, 6, 7, 8, 9, 10] * 3, [42, 17, 99, 3, 3, 3, 3]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.output_token_ids for o in LLM("tiny", max_num_seqs=2, max_model_len=64, kda_prefill_backend="reference",
                                              kda_decode_backend="reference").generate(prompts, params, use_tqdm=False)]
    llm = LLM("tiny", max_num_seqs=2, max_model_len=64, kda_prefill_backend="flash", kda_decode_backend="fused",
              speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 1})
    assert [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0


def test_prefix_caching_with_checkpoints_inside_flash():
    """flash writes the checkpoints a prompt crosses inside its launch (interpreted): a prompt that
    diverges from a cached one at 70 resumes from the checkpoint at 64, which no step ended on
    (one 100-token chunk), with the greedy tokens and log-probs of the reference backends."""
    import random

    rng = random.Random(1)
    a = [rng.randrange(1, 250) for _ in range(100)]
    b = a[:70] + [251] + a[71:90]
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0)
    plain = LLM("tiny", max_num_seqs=2, max_model_len=128, kda_prefill_backend="reference",
                kda_decode_backend="reference")
    llm = LLM("tiny", max_num_seqs=2, max_model_len=128, kda_prefill_backend="flash", kda_decode_backend="chain",
              enable_prefix_caching=True, mamba_block_size=32, prefix_cache_states=4)
    assert llm.engine.prefix_cache.in_step
    steps = llm.engine.counters["steps"]
    llm.generate([a], params, use_tqdm=False)
    assert llm.engine.counters["steps"] - steps == 3, "one prefill step and two decodes: no chunk cut"
    for prompt in (a, b):
        got, want = (x.generate([prompt], params, use_tqdm=False)[0] for x in (llm, plain))
        assert got.output_token_ids == want.output_token_ids
        assert all(abs(p["logprob"] - q["logprob"]) <= 1e-4 for p, q in zip(got.logprobs, want.logprobs))
    assert got.metrics["num_cached_tokens"] == 64
