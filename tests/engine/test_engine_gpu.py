"""The engine on a GPU: Triton KDA backends, CUDA-graph decode (padding rows on the null slot),
the `bench` model. Run: pytest -q tests/engine/test_engine_gpu.py (skipped without a GPU)."""

import pytest
import torch

from kdaserve.engine import LLM, SamplingParams
from kdaserve.testing.speculative import ScriptedProposer

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "KDA", "A longer prompt " * 12]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _tiny(prefill, decode, **kw):
    # fp32 keeps greedy comparisons free of bf16 rounding flips.
    kw = {"max_num_seqs": 8, "max_model_len": 512, **kw}
    return LLM("tiny", device="cuda", dtype="float32", kda_prefill_backend=prefill, kda_decode_backend=decode, **kw)


def _ids(outs):
    return [o.output_token_ids for o in outs]


def _no_leaks(llm):
    s = llm.engine.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("decode", ["chain", "fused", "adaptive"])
def test_cuda_graph_decode_equals_eager_and_batch_equals_alone(decode):
    eager = _tiny("flash", decode, enforce_eager=True)
    graphs = _tiny("flash", decode)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    want = _ids(eager.generate(PROMPTS, GREEDY, use_tqdm=False))
    got = _ids(graphs.generate(PROMPTS, GREEDY, use_tqdm=False))      # 4 rows replay the bucket of 4
    assert got == want
    alone = [_ids(graphs.generate(PROMPTS[i : i + 1], GREEDY, use_tqdm=False))[0] for i in range(3)]
    assert alone == want[:3]
    three = _ids(graphs.generate(PROMPTS[:3], GREEDY, use_tqdm=False))  # 3 real rows + 1 padding row
    assert three == want[:3]
    _no_leaks(graphs)


def test_triton_backends_agree_with_the_reference():
    ref = _ids(_tiny("reference", "reference", enforce_eager=True).generate(PROMPTS, GREEDY, use_tqdm=False))
    tri = _ids(_tiny("flash", "chain").generate(PROMPTS, GREEDY, use_tqdm=False))
    # fp32 everywhere, but Triton dots may use TF32: demand agreement on most tokens, not all.
    same = sum(a == b for r, t in zip(ref, tri) for a, b in zip(r, t))
    assert same >= 0.9 * sum(map(len, ref)), (ref, tri)


def test_chunked_prefill_and_preemption_on_gpu():
    base = _ids(_tiny("flash", "chain").generate(PROMPTS, GREEDY, use_tqdm=False))
    chunked = _tiny("flash", "chain", max_num_batched_tokens=24)
    assert _ids(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == base
    # Four 15-token prompts growing to 39 tokens need 12 blocks of 16; the pool has 6.
    prompts = [f"Req {i} is here." for i in range(4)]
    want = [_ids(_tiny("flash", "chain").generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    tight = _tiny("flash", "chain", num_kv_blocks=7, max_model_len=96)
    assert _ids(tight.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert tight.engine.counters["preemptions"] > 0
    _no_leaks(tight)


def test_bench_model_serves_a_batch_with_graphs():
    llm = LLM("bench", max_num_seqs=16, max_model_len=1024, cuda_graph_max_batch_size=16)
    assert llm.engine.runner.graphs is not None
    prompts = [[(7 * i + j) % 256 for j in range(100 + 13 * i)] for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert all(o.num_output_tokens == 32 for o in outs)
    again = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert _ids(again) == _ids(outs)   # same batch, same kernels: deterministic
    _no_leaks(llm)
    torch.cuda.synchronize()


@pytest.mark.parametrize("decode", ["fused", "chain"])
def test_speculative_verify_steps_replay_cuda_graphs_and_keep_the_tokens(decode):
    """Verify steps (S+1 = 4 tokens per sequence) replay graphs captured for them; with scripted
    drafts accepted at every length, the tokens equal plain decoding's, eager and graphs alike."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    plain = _tiny("flash", decode)
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS]
    want = _ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    for eager in (True, False):
        llm = _tiny("flash", decode, speculative_config=spec, enforce_eager=eager)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager and (eager or graphs.m == 4)
        llm.engine.proposer = ScriptedProposer({tuple(p): w for p, w in zip(prompts, want)}, 3, lambda call: call % 4)
        replays = []
        if graphs is not None:
            real_run = graphs.run
            graphs.run = lambda step, *source: replays.append(step.num_decodes) or real_run(step, *source)
        assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
        assert _ids(llm.generate(prompts[:3], GREEDY, use_tqdm=False)) == want[:3]   # a padding sequence in the bucket
        assert eager or replays, "verify steps must replay the captured graphs"
        assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
        _no_leaks(llm)
