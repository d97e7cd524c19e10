"""Tensor parallelism on GPUs (NCCL, CUDA graphs captured and replayed per rank in lock step,
async scheduling): two ranks give one rank's greedy tokens, and log-probs within bf16's
tolerance, for every family; needs two GPUs (one file at a time, as every GPU test)."""

import os

import pytest
import torch

from kdaserve.engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
os.environ.setdefault("KDASERVE_COLLECTIVE_TIMEOUT_S", "120")
PROMPTS = [[(7 * i + 3) % 250 for i in range(n)] for n in (5, 23, 700, 41)]
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("model", ["nano", "kimi-tiny", "glm-tiny", "glm-tiny+ep"])
def test_two_gpus_give_one_gpus_tokens(model):
    """`+ep`: --enable-expert-parallel (whole experts per rank; the fused kernels skip the others')."""
    model, _, ep = model.partition("+")
    kw = dict(device="cuda", max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=256)
    one = LLM(model, **kw).generate(PROMPTS, GREEDY, use_tqdm=False)
    torch.cuda.empty_cache()
    llm = LLM(model, tensor_parallel_size=2, enable_expert_parallel=ep == "ep", **kw)
    try:
        assert llm.engine.runner.graphs is not None and llm.engine.async_scheduling
        two = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.counters["overlapped_steps"] > 0
    finally:
        llm.engine.close()
    # bf16: a different reduction order may flip a near-tie; the first 16 tokens must agree and
    # the log-probs of agreeing tokens stay within bf16's tolerance.
    for a, b in zip(one, two):
        assert a.output_token_ids[:16] == b.output_token_ids[:16]
        for x, y in zip(a.logprobs[:16], b.logprobs[:16]):
            assert abs(x["logprob"] - y["logprob"]) < 0.05, (x, y)


def test_mtp_at_two_gpus_replays_graphs_and_is_lossless():
    """MTP speculation at two ranks: the verify steps replay each rank's graphs, the drafter's
    passes run after them on both ranks from rank 0's plan; fp32, so greedy tokens equal plain
    decoding's at one rank exactly, and some drafts are accepted."""
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=256)
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = [o.output_token_ids for o in LLM("glm-tiny", **kw).generate(PROMPTS, greedy, use_tqdm=False)]
    torch.cuda.empty_cache()
    llm = LLM("glm-tiny", tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 3},
              **kw)
    try:
        assert llm.engine.runner.graphs is not None
        assert [o.output_token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == want
        assert llm.engine.stats()["spec_decode_num_drafts"] > 0
    finally:
        llm.engine.close()
