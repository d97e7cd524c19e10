"""Async scheduling (EngineConfig.async_scheduling): a decode step is queued on the previous
step's device tokens before the host reads them. Everything a client sees must equal the engine
stepping one step at a time -- tokens, log-probs, text, finish reasons, streamed deltas -- with
requests ending by length, stop token, stop string and abort while the next step is already
queued, requests arriving mid-decode, seeded sampling, prefix-cache checkpoints taken by
overlapped decode steps; and every slot and block comes back. The `tiny` model on the CPU
(reference backends): the same code path as on a GPU, run synchronously."""

from __future__ import annotations

import random

import pytest
import torch

from kdaserve.engine import LLMEngine, SamplingParams
from kdaserve.engine.config import EngineConfig

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(1, 250) for _ in range(n)] for n in (5, 1, 17, 9, 30, 12, 7, 22, 3, 14)]


def _engine(async_scheduling: bool, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    return LLMEngine("tiny", device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference",
                     async_scheduling=async_scheduling, **kw)


def _drive(eng: LLMEngine, requests: dict, arrivals: dict[int, list[str]], aborts: dict[int, list[str]]) -> dict:
    """Step until everything ends; requests in `arrivals[k]` are added and those in `aborts[k]`
    aborted before call k. Returns per request: (streamed tokens, final output)."""
    streamed = {rid: [] for rid in requests}
    final = {}
    call = 0
    while eng.has_unfinished_requests() or any(k >= call for k in arrivals):
        for rid in arrivals.get(call, []):
            eng.add_request(rid, *requests[rid])
        for rid in aborts.get(call, []):
            eng.abort_request(rid)
        for out in eng.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in final, "one finished output per request"
                final[out.request_id] = out
        call += 1
        assert call < 500
    return {rid: (streamed[rid], final[rid]) for rid in requests}


def _same(a, b, aborted=()) -> None:
    """Equal outputs; an aborted request's tokens only as far as both got (where a call lands
    in the token stream differs: with async scheduling a call that admits a request completes
    the queued step and then runs the admitting one)."""
    for rid in a:
        (sa, fa), (sb, fb) = a[rid], b[rid]
        if rid in aborted:
            n = min(len(sa), len(sb))
            assert sa[:n] == sb[:n] and fa.finish_reason == fb.finish_reason == "abort", rid
            continue
        assert sa == sb == fa.output_token_ids == fb.output_token_ids, rid
        assert (fa.finish_reason, fa.text) == (fb.finish_reason, fb.text), rid
        assert (fa.logprobs is None) == (fb.logprobs is None), rid
        for x, y in zip(fa.logprobs or [], fb.logprobs or []):
            assert x["token_id"] == y["token_id"] and abs(x["logprob"] - y["logprob"]) < 1e-4, rid
            assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]], rid


def _drained(eng: LLMEngine) -> None:
    s = eng.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0, s
    assert not eng.has_unfinished_requests() and eng._inflight is None


def _scenario(reference: LLMEngine):
    """Requests that end in every way while a step is queued behind them; stop tokens and
    strings are taken from the reference's own greedy outputs, so they do fire mid-decode."""
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    base = _drive(reference, {"probe": (PROMPTS[6], greedy), "probe2": (PROMPTS[7], greedy)}, {0: ["probe", "probe2"]}, {})
    probe, probe2 = base["probe"][1], base["probe2"][1]
    stop_token = probe.output_token_ids[6]
    stop_text = probe2.text[len(probe2.text) // 2 :][:3]
    requests = {
        # ended by max_tokens at different steps, including the first decode
        **{f"len{n}": (PROMPTS[i], SamplingParams(max_tokens=n, ignore_eos=True)) for i, n in enumerate((1, 2, 5, 13))},
        "stop_token": (PROMPTS[6], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_token])),
        "stop_string": (PROMPTS[7], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop_text])),
        "logprobs": (PROMPTS[4], SamplingParams(max_tokens=15, ignore_eos=True, logprobs=2)),
        "seeded": (PROMPTS[5], SamplingParams(max_tokens=15, ignore_eos=True, temperature=0.9, seed=5)),
        "late": (PROMPTS[8], SamplingParams(max_tokens=9, ignore_eos=True)),       # arrives mid-decode
        "aborted": (PROMPTS[9], SamplingParams(max_tokens=40, ignore_eos=True)),   # aborted mid-decode
        "max_len": (PROMPTS[4], SamplingParams(max_tokens=200, ignore_eos=True)),  # ended by max_model_len
    }
    first = [r for r in requests if r != "late"]
    return requests, {0: first, 6: ["late"]}, {9: ["aborted"]}, (stop_token, stop_text)


def test_outputs_equal_one_step_at_a_time():
    sync_eng, async_eng = _engine(False, max_model_len=48), _engine(True, max_model_len=48)
    requests, arrivals, aborts, (stop_token, stop_text) = _scenario(sync_eng)
    want = _drive(sync_eng, requests, arrivals, aborts)
    got = _drive(async_eng, requests, arrivals, aborts)
    _same(got, want, aborted=["aborted"])
    # The scenario does what it says.
    assert want["stop_token"][1].finish_reason == "stop" and want["stop_token"][1].output_token_ids[-1] == stop_token
    assert want["stop_string"][1].finish_reason == "stop" and stop_text not in want["stop_string"][1].text
    assert want["aborted"][1].finish_reason == "abort" and 0 < len(want["aborted"][0]) < 40
    assert want["max_len"][1].finish_reason == "length" and want["max_len"][1].num_output_tokens == 48 - len(PROMPTS[4])
    assert sync_eng.counters["overlapped_steps"] == 0
    assert async_eng.counters["overlapped_steps"] >= 10
    for eng in (sync_eng, async_eng):
        _drained(eng)


def test_later_requests_reuse_the_pools_unchanged():
    """After requests ended with a step queued behind them (their slots and blocks freed while
    that step still used them), new requests on the same engine get what a fresh one gives."""
    eng = _engine(True)
    stop = SamplingParams(max_tokens=30, ignore_eos=True)
    first = {f"a{i}": (p, SamplingParams(max_tokens=3 + 4 * i, ignore_eos=True)) for i, p in enumerate(PROMPTS[:6])}
    _drive(eng, first, {0: list(first)}, {4: ["a5"]})
    _drained(eng)
    second = {f"b{i}": (p, stop) for i, p in enumerate(PROMPTS[4:])}
    got = _drive(eng, second, {0: list(second)}, {})
    want = _drive(_engine(False), second, {0: list(second)}, {})
    _same(got, want)
    _drained(eng)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, ignore_eos=True, min_tokens=4),
    SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=10, ignore_eos=True, logit_bias={7: 2.0}),
], ids=["min_tokens", "penalty", "logit_bias"])
def test_sampling_that_reads_the_tokens_before_runs_one_step_at_a_time(params):
    """Logits processors read the outputs so far: a batch with such a request is not overlapped;
    once it ends, the others are again."""
    eng, ref = _engine(True), _engine(False)
    requests = {"proc": (PROMPTS[2], params), "plain": (PROMPTS[3], SamplingParams(max_tokens=25, ignore_eos=True))}
    got = _drive(eng, requests, {0: list(requests)}, {})
    _same(got, _drive(ref, requests, {0: list(requests)}, {}))
    # "proc" decodes in 9 steps, none overlapped; "plain" alone for its last 15, overlapped.
    assert 10 <= eng.counters["overlapped_steps"] <= 15


def test_checkpoints_taken_by_overlapped_decode_steps_hold_the_state_at_their_boundary():
    """Prefix caching's checkpoints of a decode step are queued behind it before the next step
    (already scheduled) is: the state at a boundary a generated answer crosses equals the state
    computed from scratch for those tokens, and the next turn resumes from it."""
    C = 32
    eng = _engine(True, mamba_block_size=C, enable_prefix_caching=True)
    prompt = PROMPTS[4][:20]
    answer = _drive(eng, {"t1": (prompt, SamplingParams(max_tokens=90, ignore_eos=True))}, {0: ["t1"]}, {})["t1"][0]
    assert eng.counters["overlapped_steps"] > 80
    tokens = prompt + answer
    pc = eng.prefix_cache
    hashes = pc.hasher.extend([], tokens)
    for boundary in (64, 96):
        slot = pc.checkpoints.lookup(hashes[boundary // 16 - 1])
        assert slot is not None, f"a checkpoint at {boundary}"
        fresh = _engine(False, max_num_seqs=1, enable_prefix_caching=False)
        fresh.add_request("x", tokens[:boundary], SamplingParams(max_tokens=1))
        while fresh.has_unfinished_requests():
            fresh.step()
        for (conv, rec), (conv_f, rec_f) in zip(eng.runner.caches.kda, fresh.runner.caches.kda):
            torch.testing.assert_close(conv[slot], conv_f[1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rec[slot], rec_f[1], rtol=1e-5, atol=1e-5)
    turn2 = tokens + PROMPTS[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
    got = _drive(eng, {"t2": (turn2, params)}, {0: ["t2"]}, {})
    assert got["t2"][1].metrics["num_cached_tokens"] == len(tokens) // C * C
    _same(got, _drive(_engine(False), {"t2": (turn2, params)}, {0: ["t2"]}, {}))
    _drained(eng)


def test_preemption_with_a_step_queued():
    """KV blocks run short while decode steps are overlapped: the step that needs a new block
    goes through the scheduler's full pass (preemption), outputs stay those of a roomy engine."""
    prompts = {f"p{i}": ([i + 1] * 15, SamplingParams(max_tokens=14, ignore_eos=True)) for i in range(4)}
    tight = _engine(True, num_kv_blocks=7, max_model_len=96)
    got = _drive(tight, prompts, {0: list(prompts)}, {})
    assert tight.counters["preemptions"] > 0 and tight.counters["overlapped_steps"] > 0
    _same(got, _drive(_engine(False), prompts, {0: list(prompts)}, {}))
    _drained(tight)


def test_a_step_and_its_device_inputs_come_together():
    """ModelRunner.execute refuses a batch whose inputs are rows of device tokens without those
    tokens, and device tokens for a batch that reads its inputs from the host."""
    from kdaserve.engine.scheduler import ScheduledBatch

    eng = _engine(True)
    eng.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    seq = eng.requests["r"]
    message = "a step with input_rows needs the device tokens they index"
    with pytest.raises(ValueError, match=message):
        eng.runner.execute(ScheduledBatch(decodes=[seq], input_rows=[0]))
    with pytest.raises(ValueError, match=message):
        eng.runner.execute(ScheduledBatch(decodes=[seq]), torch.zeros(1, dtype=torch.int64))


def test_the_setting_follows_vllm():
    assert EngineConfig(device="cuda").async_scheduling is True    # the default where the device runs apart
    assert EngineConfig(device="cpu").async_scheduling is False    # torch on a CPU runs in the host's thread
    assert EngineConfig(device="cpu", async_scheduling=True).async_scheduling is True
    assert EngineConfig(device="cuda", async_scheduling=False).async_scheduling is False
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert EngineConfig(device="cuda", speculative_config=ngram).async_scheduling is False
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        EngineConfig(device="cuda", speculative_config=ngram, async_scheduling=True)
    import argparse

    from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args

    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_kwargs_from_args(parser.parse_args(["--no-async-scheduling"]))["async_scheduling"] is False
    assert engine_kwargs_from_args(parser.parse_args([]))["async_scheduling"] is None


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["cuda_graphs", "eager"])
def test_on_a_gpu_outputs_equal_one_step_at_a_time(eager):
    """The device path: the inputs gathered on the GPU from the step before's tokens (into the
    graphs' static buffers, or the eager step's staged buffer), the tokens read back behind the
    next step; Triton backends, fp32 (no bf16 rounding flips in a greedy comparison)."""
    kw = dict(device="cuda", dtype="float32", kda_prefill_backend="flash", kda_decode_backend="fused",
              max_model_len=48, enforce_eager=eager)
    sync_eng = LLMEngine("tiny", async_scheduling=False, max_num_seqs=8, **kw)
    async_eng = LLMEngine("tiny", async_scheduling=True, max_num_seqs=8, **kw)
    requests, arrivals, aborts, _ = _scenario(sync_eng)
    want = _drive(sync_eng, requests, arrivals, aborts)
    got = _drive(async_eng, requests, arrivals, aborts)
    _same(got, want, aborted=["aborted"])
    assert async_eng.counters["overlapped_steps"] >= 10
    _drained(async_eng)


def test_a_request_that_cannot_be_admitted_does_not_stop_the_overlap():
    """Every KV block held by the running requests: the waiting one cannot be admitted, so the
    decode steps stay overlapped until blocks come back; then it is admitted as usual."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = {f"r{i}": ([i + 3] * 16, params) for i in range(4)}   # 16 tokens: one full block each
    eng = _engine(True, num_kv_blocks=7, max_model_len=64)           # 6 blocks: 3 requests of 17-32 tokens
    streamed = {rid: [] for rid in prompts}
    for rid in ("r0", "r1", "r2"):
        eng.add_request(rid, *prompts[rid])
    for out in eng.step():                                           # their prefills
        streamed[out.request_id] += out.new_token_ids
    eng.add_request("r3", *prompts["r3"])
    overlapped_while_waiting = 0
    while eng.has_unfinished_requests():
        before, waiting = eng.counters["overlapped_steps"], bool(eng.scheduler.waiting)
        for out in eng.step():
            streamed[out.request_id] += out.new_token_ids
        overlapped_while_waiting += waiting and eng.counters["overlapped_steps"] > before
    assert overlapped_while_waiting >= 5
    want = _drive(_engine(False), prompts, {0: list(prompts)}, {})
    assert streamed == {rid: want[rid][0] for rid in prompts}
    _drained(eng)
