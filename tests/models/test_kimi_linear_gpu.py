"""Kimi-Linear on a GPU: the Triton paths (flash + fused KDA, MLA and MoE kernels) against the torch
reference paths on the same weights, CUDA graphs against eager, and the capacity error.
Run: pytest -q tests/models/test_kimi_linear_gpu.py (skipped without a GPU)."""

import pytest

from kdaserve.engine import LLM, SamplingParams
from kdaserve.testing.speculative import ScriptedProposer

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "KDA", "A longer prompt " * 12]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
TRITON = dict(kda_prefill_backend="flash", kda_decode_backend="fused", mla_backend="triton", moe_backend="triton")
REF = dict(kda_prefill_backend="reference", kda_decode_backend="reference", mla_backend="reference", moe_backend="reference")


def _ids(llm, prompts=PROMPTS):
    return [o.output_token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_triton_paths_agree_with_the_reference_and_graphs_with_eager():
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512)
    ref = _ids(LLM("kimi-tiny", enforce_eager=True, **REF, **kw))
    eager = _ids(LLM("kimi-tiny", enforce_eager=True, **TRITON, **kw))
    graphs_llm = LLM("kimi-tiny", **TRITON, **kw)
    assert graphs_llm.engine.runner.graphs is not None
    assert _ids(graphs_llm) == eager
    assert _ids(graphs_llm, PROMPTS[:3]) == eager[:3]          # 3 real rows + 1 padding row of the bucket of 4
    # fp32 everywhere, but Triton dots may use TF32 for 16-bit-free paths: most tokens, not all.
    same = sum(a == b for r, t in zip(ref, eager) for a, b in zip(r, t))
    assert same >= 0.9 * sum(map(len, ref)), (ref, eager)
    s = graphs_llm.engine.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0


def test_bf16_serves_a_batch_with_graphs_and_chunked_prefill():
    llm = LLM("kimi-tiny", device="cuda", max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=64)
    prompts = [[(7 * i + j) % 256 for j in range(50 + 37 * i)] for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(o.num_output_tokens == 16 for o in outs)
    again = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs]


def test_too_many_sequences_is_an_error_that_says_how_many_fit():
    """Ten million sequences of kimi-tiny's ~30 KB of KDA state each cannot fit on any card."""
    with pytest.raises(RuntimeError,
                       match=r"max_num_seqs=10000000 needs .* GiB of KDA state \(.* KiB per state slot\) .*: \d+ sequences fit; "
                             r"lower --max-num-seqs to at most \d+, or raise"):
        LLM("kimi-tiny", device="cuda", max_num_seqs=10_000_000, max_model_len=512)


def test_speculative_decoding_keeps_the_tokens_with_mla_and_moe_kernels():
    """Verify steps through the Triton MLA decode kernel (each draft a row with its own context),
    the fused MoE kernel and fused KDA verify, CUDA graphs on: the tokens of plain decoding."""
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512, **TRITON)
    plain = LLM("kimi-tiny", **kw)
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS]
    want = _ids(plain, prompts)
    llm = LLM("kimi-tiny", speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 1}, **kw)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.m == 3
    # Wrong at position (call + 1) % 3 of each call's drafts (2 = none of the two): every acceptance length.
    llm.engine.proposer = ScriptedProposer({tuple(p): w for p, w in zip(prompts, want)}, 2, lambda call: (call + 1) % 3,
                                           vocab_size=plain.engine.vocab_size)
    assert _ids(llm, prompts) == want
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
