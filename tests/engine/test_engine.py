"""The engine end to end on the `tiny` built-in (CPU, reference KDA backends)."""

import pytest

from kdaserve.engine import LLM, LLMEngine, SamplingParams

PROMPTS = [
    "Hello",
    "H",                    # one token, no history: a prefill, never a decode
    "The quick brown fox jumps over the lazy dog",
    "KDA",
    "A longer prompt, so that chunked prefill has several chunks to work through.",
]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _engine(**kw) -> LLM:
    kw.setdefault("kda_prefill_backend", "reference")
    kw.setdefault("kda_decode_backend", "reference")
    kw.setdefault("max_model_len", 256)
    return LLM("tiny", max_num_seqs=8, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return _engine()


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].output_token_ids for p in PROMPTS]


def _no_leaks(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0, s
    assert s["num_running"] == 0 and s["num_waiting"] == 0, s
    assert not llm.engine.has_unfinished_requests()


def test_batch_equals_each_request_alone(llm, alone):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and o.num_output_tokens == 12 for o in outs)
    _no_leaks(llm)


def test_chunked_prefill_equals_unchunked(alone):
    small = _engine(max_num_batched_tokens=5)
    outs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == alone
    _no_leaks(small)


def test_preempted_requests_resume_with_the_same_tokens(llm):
    # Four 15-token prompts fit one 16-token block each at admission; growing to 27 tokens they
    # need 8 blocks, and the pool has 6: the newest get preempted and recomputed.
    prompts = [f"Req {i} is here." for i in range(4)]
    want = [llm.generate([p], GREEDY, use_tqdm=False)[0].output_token_ids for p in prompts]
    tight = _engine(num_kv_blocks=7, max_model_len=96)
    outs = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert tight.engine.counters["preemptions"] > 0
    assert any(o.metrics["num_preemptions"] for o in outs)
    assert [o.output_token_ids for o in outs] == want
    _no_leaks(tight)


def test_decode_path_agrees_with_prefill_path(llm, alone):
    """Teacher forcing: prompt log-probs over prompt + generated tokens pick the same tokens, with
    the same log-probs as the decode steps reported (positions, caches and states all agree)."""
    tok = llm.tokenizer
    for prompt in (PROMPTS[1], PROMPTS[4]):
        gen = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
        ids = tok.encode(prompt) + gen.output_token_ids[:-1]
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        lp = out.prompt_logprobs
        assert lp[0] is None and len(lp) == len(ids)
        n = len(tok.encode(prompt))
        forced = [lp[i]["top"][0][0] for i in range(n, len(ids))] + out.output_token_ids
        assert forced == gen.output_token_ids
        decoded = [x["logprob"] for x in gen.logprobs[:-1]]
        prefilled = [lp[i]["logprob"] for i in range(n, len(ids))]
        assert decoded == pytest.approx(prefilled, rel=1e-4, abs=1e-5)


def test_bad_requests_fail_clearly_and_disturb_nothing(llm, alone):
    eng: LLMEngine = llm.engine
    tok = llm.tokenizer
    eng.add_request("good", tok.encode(PROMPTS[1]), GREEDY)
    before = eng.stats()
    with pytest.raises(ValueError, match="prompt too long: got 300 tokens; expected at most 255"):
        eng.add_request("long", [1] * 300, GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="prompt token"):
        eng.add_request("oov", [1, 10**6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("good", [1], GREEDY)
    with pytest.raises(ValueError, match="logprobs: got 50"):
        eng.add_request("lp", [1], SamplingParams(logprobs=50))
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request("t", [1], SamplingParams(temperature=-1))
    assert eng.stats() == before
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == "good"
            final = o
    assert final.finished and final.output_token_ids == alone[1]
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate(["ok", ""], GREEDY, use_tqdm=False)
    _no_leaks(llm)


def test_abort_frees_slot_and_blocks_and_is_reported(llm):
    eng = llm.engine
    eng.add_request("a", llm.tokenizer.encode(PROMPTS[3]), SamplingParams(max_tokens=50))
    eng.add_request("b", llm.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    assert eng.stats()["state_slots_used"] == 2 and eng.stats()["kv_blocks_used"] > 0
    eng.abort_request("a")
    eng.abort_request("unknown")
    assert eng.stats()["state_slots_used"] == 1
    outs = eng.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    _no_leaks(llm)


def test_streaming_outputs_add_up(llm, alone):
    eng = llm.engine
    eng.add_request("s", llm.tokenizer.encode(PROMPTS[1]), GREEDY)
    pieces, last = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            pieces += o.new_token_ids
            last = o
    assert pieces == alone[1] == last.output_token_ids
    assert last.text == llm.tokenizer.decode(alone[1])
    assert last.num_prompt_tokens == len(llm.tokenizer.encode(PROMPTS[1]))


def test_each_step_is_built_once_for_all_kda_layers(monkeypatch):
    """The model runner builds a step's KDA part once; every KDA layer takes it from the context
    (a layer building for itself would call build_step once per layer). Every layer holds the
    loader's pair, the one the engine and the runner keep (one object down, nothing read back)."""
    from kdaserve.backends.kda_backends import KDABackends
    from kdaserve.layers.kda import KDALayer

    llm = _engine()
    layers = llm.engine.runner.model.kda_layers
    assert len(layers) > 1
    assert all(layer.backends is llm.engine.kda_backends for layer in layers)
    assert llm.engine.runner.kda_backends is llm.engine.kda_backends
    plans, forwards = [], []
    real_plan, real_forward = KDABackends.build_step, KDALayer._forward
    monkeypatch.setattr(KDABackends, "build_step", lambda self, meta: plans.append(meta) or real_plan(self, meta))
    monkeypatch.setattr(KDALayer, "_forward", lambda self, *a: forwards.append(self.layer_idx) or real_forward(self, *a))
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    steps = llm.engine.counters["steps"]
    assert steps > 1 and len(plans) == steps
    assert len(forwards) == steps * len(llm.engine.runner.model.kda_layers)
