"""Ling-3 on a GPU: the Triton paths (flash + fused KDA with full-rank gates, the MLA kernels over the
rotated latent cache, the fused MoE with grouped routing) against the torch reference paths on the
same weights, CUDA graphs against eager, bf16 with chunked prefill, and the MTP drafter under graphs.
Run: pytest -q tests/models/test_bailing_hybrid_gpu.py (skipped without a GPU)."""

import pytest

from kdaserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "KDA", "A longer prompt " * 12]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
TRITON = dict(kda_prefill_backend="flash", kda_decode_backend="fused", mla_backend="triton", moe_backend="triton")
REF = dict(kda_prefill_backend="reference", kda_decode_backend="reference", mla_backend="reference", moe_backend="reference")
MTP3 = dict(speculative_config={"method": "mtp", "num_speculative_tokens": 3})


def _ids(llm, prompts=PROMPTS):
    return [o.output_token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_triton_paths_agree_with_the_reference_and_graphs_with_eager():
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512)
    ref = _ids(LLM("ling-tiny", enforce_eager=True, **REF, **kw))
    eager = _ids(LLM("ling-tiny", enforce_eager=True, **TRITON, **kw))
    graphs_llm = LLM("ling-tiny", **TRITON, **kw)
    assert graphs_llm.engine.runner.graphs is not None
    assert _ids(graphs_llm) == eager
    assert _ids(graphs_llm, PROMPTS[:3]) == eager[:3]          # 3 real rows + 1 padding row of the bucket of 4
    # fp32 everywhere, but Triton dots may use TF32 for 16-bit-free paths: most tokens, not all.
    same = sum(a == b for r, t in zip(ref, eager) for a, b in zip(r, t))
    assert same >= 0.9 * sum(map(len, ref)), (ref, eager)
    s = graphs_llm.engine.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0


def test_bf16_serves_a_batch_with_graphs_and_chunked_prefill():
    llm = LLM("ling-tiny", device="cuda", max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=64)
    prompts = [[(7 * i + j) % 256 for j in range(50 + 37 * i)] for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(o.num_output_tokens == 16 for o in outs)
    again = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs]


def test_mtp_with_cuda_graphs_is_lossless():
    """Verify steps replay CUDA graphs; the MTP layer (gated MLA with RoPE, grouped MoE) drafts after
    them: the greedy tokens of eager MTP and of no speculation (Triton kernels, fp32)."""
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512, **TRITON)
    want = _ids(LLM("ling-tiny", enforce_eager=True, **kw))
    eager = LLM("ling-tiny", enforce_eager=True, **kw, **MTP3)
    graphs = LLM("ling-tiny", **kw, **MTP3)
    assert graphs.engine.runner.graphs is not None
    assert _ids(graphs) == _ids(eager) == want
    assert graphs.engine.stats()["spec_decode_num_drafts"] > 0
