"""Structured output on a GPU: the bitmask staged to the device and applied by xgrammar's Triton
kernel (every row, and picked rows), and the `tiny` model with CUDA graphs following its grammars
while rows without one keep their tokens. Run: pytest -q tests/engine/test_structured_outputs_gpu.py"""

import json
import re

import pytest
import torch

from kdaserve.engine import LLM, SamplingParams
from kdaserve.engine.staging import StagingRing
from kdaserve.engine.structured_output.bitmask import apply_grammar_masks

pytestmark = pytest.mark.gpu
pytest.importorskip("xgrammar")

NO_SPACE = {9: -100, 10: -100, 13: -100, 32: -100}


class _Matcher:
    def __init__(self, allowed):
        self.allowed = allowed

    def fill_next_token_bitmask(self, bitmask, row):
        bits = torch.zeros(bitmask.shape[1] * 32, dtype=torch.bool)
        bits[self.allowed] = True
        words = (bits.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(-1)
        bitmask[row] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class _Seq:
    def __init__(self, grammar=None):
        self.grammar = grammar


@pytest.mark.parametrize("rows", [[0, 5, 6], list(range(8))])
def test_bitmask_on_the_device(rows):
    g = torch.Generator().manual_seed(1)
    V = 1000
    logits = torch.randn(8, V, generator=g).cuda()
    before = logits.clone()
    allowed = {r: torch.randperm(V, generator=g)[:40].tolist() + [V - 1] for r in rows}
    seqs = [_Seq(_Matcher(allowed[r]) if r in allowed else None) for r in range(8)]
    apply_grammar_masks(logits, seqs, StagingRing(64, torch.device("cuda")))
    for r in range(8):
        if r not in allowed:
            assert torch.equal(logits[r], before[r])
            continue
        keep = torch.zeros(V, dtype=torch.bool, device="cuda")
        keep[allowed[r]] = True
        assert torch.equal(logits[r][keep], before[r][keep]) and bool((logits[r][~keep] == float("-inf")).all())


def test_grammars_with_cuda_graphs():
    llm = LLM("tiny", device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512)
    assert llm.engine.runner.graphs is not None
    prompts = ["Hello", "KDA", "The quick brown fox", "x"]
    alone = [llm.generate([p], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)[0].output_token_ids
             for p in prompts]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "c": {"type": "string", "enum": ["a", "b"]}},
              "required": ["ok", "c"]}
    specs = [{"regex": "[a-z]{3}-[0-9]{2}"}, None, {"json": schema, "disable_any_whitespace": True}, None]
    params = [SamplingParams(max_tokens=60, structured_outputs=s, logit_bias=NO_SPACE) if s else
              SamplingParams(max_tokens=16, ignore_eos=True) for s in specs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", outs[0].text) and outs[0].finish_reason == "stop"
    obj = json.loads(outs[2].text)
    assert set(obj) == {"ok", "c"} and obj["c"] in ("a", "b")
    assert outs[1].output_token_ids == alone[1] and outs[3].output_token_ids == alone[3]


def test_grammars_with_speculative_decoding_and_cuda_graphs():
    """Verify rows masked after their drafts (the rejection sampler's grammar path) on the device,
    with CUDA-graph verify steps: greedy tokens equal plain decoding's under the same grammar."""
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512)
    plain = LLM("tiny", **kw)
    spec = LLM("tiny", **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    prompts = ["abcabcabcabc", "xyz xyz xyz", "1212121212"]
    params = SamplingParams(max_tokens=60, structured_outputs={"regex": "([a-z]+ ){4,10}"})
    want = [o.output_token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.output_token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 0
