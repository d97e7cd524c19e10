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
