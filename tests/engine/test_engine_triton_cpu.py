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
