"""Structured output on the `tiny` model (CPU, reference backends): every output follows its
grammar, greedy picks the best allowed token, rows without a grammar are untouched, and bad
constraints are refused before anything runs."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from kdaserve.engine import LLM, SamplingParams
from kdaserve.engine.staging import StagingRing
from kdaserve.engine.structured_output import StructuredOutputsParams
from kdaserve.engine.structured_output.bitmask import apply_grammar_masks

# The random model likes whitespace; where a grammar allows any amount, these biases keep the
# outputs short (the grammar still decides what is allowed).
NO_SPACE = {9: -100, 10: -100, 13: -100, 32: -100}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "color": {"type": "string", "enum": ["red", "green"]}},
          "required": ["ok", "n", "color"]}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference", max_model_len=256,
               max_num_seqs=8)


def _gen(llm, prompts, **kw):
    kw.setdefault("max_tokens", 120)
    params = [SamplingParams(**kw) for _ in prompts] if not isinstance(kw.get("structured_outputs"), list) else None
    return llm.generate(prompts, params, use_tqdm=False)


def _follows_schema(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"ok", "n", "color"} and isinstance(obj["ok"], bool)
            and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99 and obj["color"] in ("red", "green"))


class _FakeMatcher:
    def __init__(self, allowed: list[int]):
        self.allowed = allowed

    def fill_next_token_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for t in self.allowed:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)


class _Seq:
    def __init__(self, grammar=None):
        self.grammar = grammar


@pytest.mark.parametrize("rows", [[1, 3], [0, 1, 2, 3, 4]])
def test_masks_forbid_exactly_what_the_grammar_forbids(rows):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g)
    before = logits.clone()
    allowed = {r: sorted(torch.randperm(100, generator=g)[:7].tolist()) + [31, 63] for r in rows}
    seqs = [_Seq(_FakeMatcher(allowed[r]) if r in allowed else None) for r in range(5)]
    apply_grammar_masks(logits, seqs, StagingRing(16, torch.device("cpu")))
    for r in range(5):
        if r not in allowed:
            assert torch.equal(logits[r], before[r]), "a row without a grammar changed"
            continue
        keep = torch.zeros(100, dtype=torch.bool)
        keep[allowed[r]] = True
        assert torch.equal(logits[r][keep], before[r][keep])
        assert bool((logits[r][~keep] == float("-inf")).all())


def test_outputs_follow_their_grammar(llm):
    cases = [
        ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        ({"regex": "[a-z]{2,5}-[0-9]{3}"}, lambda t: re.fullmatch("[a-z]{2,5}-[0-9]{3}", t)),
        ({"grammar": 'root ::= "(" digit digit? digit? ")"\ndigit ::= [0-9]'}, lambda t: re.fullmatch(r"\([0-9]{1,3}\)", t)),
        ({"grammar": 'start: "<" NAME ">"\nNAME: /[a-z]{1,6}/'}, lambda t: re.fullmatch("<[a-z]{1,6}>", t)),   # Lark
        ({"json": SCHEMA, "disable_any_whitespace": True}, lambda t: _follows_schema(json.loads(t))),
        ({"json": json.dumps(SCHEMA)}, lambda t: _follows_schema(json.loads(t))),
    ]
    prompts = ["Hello", "The answer:", "KDA", "x"]
    for spec, ok in cases:
        for out in _gen(llm, prompts, structured_outputs=spec, logit_bias=NO_SPACE, max_tokens=60):
            assert out.finish_reason == "stop", (spec, out.text)
            assert ok(out.text), (spec, out.text)
            assert out.output_token_ids[-1] == llm.engine.output.eos_token_id, "a grammar ends with the model's end token"


def test_json_object_and_sampling(llm):
    params = [SamplingParams(max_tokens=150, temperature=0.9, seed=s, logit_bias=NO_SPACE,
                             structured_outputs={"json_object": True}) for s in range(4)]
    outs = llm.generate(["a", "b", "c", "d"], params, use_tqdm=False)
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:   # cut by max_tokens: still the start of an object
            assert out.text.startswith("{")


def test_greedy_takes_the_best_allowed_token(llm):
    """Replaying the grammar on the host: each output token is allowed, and no allowed token
    among the model's 20 most likely was more likely than it."""
    import xgrammar as xgr

    spec = {"regex": "[a-f]{3,8}( [0-9]+)?"}
    out = _gen(llm, ["Hello there"], structured_outputs=spec, logprobs=20, max_tokens=30)[0]
    params = StructuredOutputsParams(**spec)
    matcher = llm.engine._grammar_compiler.matcher(params)
    bitmask = xgr.allocate_token_bitmask(1, llm.engine.vocab_size)
    for token, entry in zip(out.output_token_ids, out.logprobs):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = lambda t: (int(bitmask[0, t // 32]) >> (t % 32)) & 1   # noqa: E731
        assert allowed(token), token
        best = max((lp for t, lp in entry["top"] if allowed(t)), default=float("-inf"))
        assert entry["logprob"] >= best
        assert matcher.accept_token(token)


def test_rows_without_a_grammar_are_unchanged(llm):
    prompts = ["Hello", "KDA", "The quick brown fox", "x"]
    alone = [_gen(llm, [p], max_tokens=12, ignore_eos=True)[0].output_token_ids for p in prompts]
    mixed = [SamplingParams(max_tokens=12, ignore_eos=True) if i % 2 else
             SamplingParams(max_tokens=40, structured_outputs={"regex": "[0-9]{4}"}) for i in range(4)]
    outs = llm.generate(prompts, mixed, use_tqdm=False)
    for i, out in enumerate(outs):
        if i % 2:
            assert out.output_token_ids == alone[i]
        else:
            assert re.fullmatch("[0-9]{4}", out.text)


def test_preempted_request_keeps_its_grammar_state(llm):
    spec = {"regex": "[a-z]{10,20}"}
    prompts = [f"Req {i} is here." for i in range(4)]
    want = [o.output_token_ids for o in _gen(llm, prompts, structured_outputs=spec, max_tokens=40)]
    tight = LLM("tiny", device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference", max_model_len=96,
                max_num_seqs=8, num_kv_blocks=7)
    outs = _gen(tight, prompts, structured_outputs=spec, max_tokens=40)
    assert tight.engine.counters["preemptions"] > 0
    assert [o.output_token_ids for o in outs] == want
    assert all(re.fullmatch("[a-z]{10,20}", o.text) for o in outs)


def test_special_tokens_are_never_allowed(llm):
    import xgrammar as xgr

    compiler = (llm.engine._grammar_compiler
                or llm.engine.compile_grammar(StructuredOutputsParams(regex="a")) and llm.engine._grammar_compiler)
    bitmask = xgr.allocate_token_bitmask(1, llm.engine.vocab_size)
    m = compiler.matcher(StructuredOutputsParams(json_object=True))
    assert m.accept_string('{"a": "')   # inside a string: any text goes
    m.fill_next_token_bitmask(bitmask)
    allowed = [t for t in range(llm.engine.vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert ord("x") in allowed
    assert not [t for t in allowed if t >= 256], "special tokens (and padded ids) are not text"


@pytest.mark.parametrize("spec, message", [
    ({"regex": "[0-9"}, "invalid structured_outputs.regex"),
    ({"json": {"type": "nope"}}, "invalid structured_outputs.json"),
    ({"grammar": 'root ::= missing'}, "invalid structured_outputs.grammar"),
])
def test_bad_constraints_are_refused_before_anything_runs(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    assert "bad" not in llm.engine.requests and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"regx": "a"}}, "regx"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"structured_outputs": {"json": "{not json"}}, "JSON schema"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens"),
    ({"structured_outputs": {"regex": "x" * 70000}}, "at most"),
])
def test_bad_params_say_what_is_expected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_with_speculative_decoding_the_tokens_are_those_without(llm):
    """Prompt-lookup drafts under a grammar: cut to what the grammar allows, each verify row masked
    after the drafts before it; greedy tokens equal plain decoding's under the same grammar, and
    drafts were both proposed and accepted."""
    spec = LLM("tiny", device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference", max_model_len=256,
               max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    prompts = ["abcabcabcabc", "xyz xyz xyz", "1212121212"]
    for spec_fields in ({"regex": "[a-c]{20,40}"}, {"regex": "([a-z]+ ){4,10}"},
                        {"json": SCHEMA, "disable_any_whitespace": True}):
        params = SamplingParams(max_tokens=60, structured_outputs=spec_fields)
        want = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        got = [o.output_token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        assert got == want, spec_fields
    s = spec.engine.stats()
    assert s["spec_decode_num_draft_tokens"] > s["spec_decode_num_accepted_tokens"] > 0, s


def test_verify_rows_get_the_mask_after_their_drafts(llm):
    from types import SimpleNamespace

    from kdaserve.engine.structured_output.bitmask import apply_grammar_masks_to_verify_rows

    llm.engine.compile_grammar(StructuredOutputsParams(regex="a"))
    compiler, eos = llm.engine._grammar_compiler, llm.engine.output.eos_token_id
    V = llm.engine.vocab_size
    a, b, x = ord("a"), ord("b"), ord("x")
    m1 = compiler.matcher(StructuredOutputsParams(regex="ab"))
    m2 = compiler.matcher(StructuredOutputsParams(regex="ab"))
    groups = [SimpleNamespace(seq=SimpleNamespace(grammar=m1), first_row=0, drafts=[a, b, eos]),
              SimpleNamespace(seq=SimpleNamespace(grammar=None), first_row=4, drafts=[]),
              SimpleNamespace(seq=SimpleNamespace(grammar=m2), first_row=5, drafts=[a, x, b])]
    logits = torch.zeros(9, V)
    apply_grammar_masks_to_verify_rows(logits, groups, StagingRing(16, torch.device("cpu")))
    allowed = [set(torch.nonzero(row == 0).flatten().tolist()) for row in logits]
    assert allowed[:4] == [{a}, {b}, {eos}, {eos}], "after the grammar's end the row repeats the last mask"
    assert allowed[4] == set(range(V)), "a row without a grammar is untouched"
    assert allowed[5:] == [{a}, {b}, {b}, {b}], "after a refused draft the rows repeat the last mask"
    assert m1.accept_token(a) and m2.accept_token(a), "the matchers are rolled back to where they were"


WHITESPACE = {9: 100, 10: 100, 13: 100, 32: 100}   # a model that would write only whitespace


@pytest.mark.parametrize("bound", [16, 4])
def test_json_whitespace_runs_are_bounded(bound):
    """A small model that prefers whitespace writes '{' then whitespace until max_tokens unless the
    grammar bounds a run (--structured-outputs-max-whitespace; 0: unbounded, the second engine)."""
    kw = dict(device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference", max_model_len=256)
    bounded = LLM("tiny", structured_outputs_max_whitespace=bound, **kw)
    unbounded = LLM("tiny", structured_outputs_max_whitespace=0, **kw)
    for spec in (dict(json_object=True), dict(json=SCHEMA)):   # a params object per engine: it keeps its compile
        def params():
            return dict(max_tokens=80, logit_bias=WHITESPACE, structured_outputs=StructuredOutputsParams(**spec))
        text = _gen(bounded, [[65]], **params())[0].text
        assert 0 < _longest_whitespace_between_tokens(text) <= bound and len(text.strip()) > 1, repr(text)
        loose = _gen(unbounded, [[65]], **params())[0].text
        assert _longest_whitespace_between_tokens(loose) > bound, repr(loose)


def _longest_whitespace_between_tokens(text: str) -> int:
    """The longest run of whitespace outside JSON strings (inside one, spaces are the string's own
    characters, which the bound leaves alone)."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*("|$)', '"', text)
    return max((len(r) for r in re.findall(r"\s+", outside)), default=0)


def test_the_whitespace_bound_is_checked():
    with pytest.raises(ValueError, match="invalid structured_outputs_max_whitespace: got -1; expected an integer >= 0"):
        LLM("tiny", device="cpu", structured_outputs_max_whitespace=-1)
