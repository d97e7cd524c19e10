"""The startup warm-up (engine/warmup.py) on the CPU (pinned: on a GPU machine the default device
would be the GPU, whose token cap and warm-up default differ) with the reference backends: it covers the
step shapes whose kernel variants a GPU would otherwise compile inside the first requests, stays
within the engine's limits, gives every state slot and KV block back, and changes no later output."""

import pytest
import torch

import kdaserve.engine.llm_engine as llm_engine
from kdaserve.engine import LLMEngine, SamplingParams
from kdaserve.engine.warmup import CPU_TOKEN_CAP, warm_up

REQUESTS = [
    ("greedy", list(b"The warm-up must not change me"), SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)),
    ("random", list(b"Nor me, drawn from the global generator"), SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)),
    ("seeded", list(b"Nor me"), SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True)),
    ("scored", list(b"Score this prompt"), SamplingParams(max_tokens=3, prompt_logprobs=1, ignore_eos=True)),
]


def _engine(**kw) -> LLMEngine:
    kw = {"device": "cpu", "max_num_seqs": 32, "max_model_len": 256, "kda_prefill_backend": "reference",
          "kda_decode_backend": "reference", "warmup": False, **kw}
    return LLMEngine("tiny", **kw)


def _run(engine: LLMEngine) -> dict:
    for rid, prompt, params in REQUESTS:
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = (o.output_token_ids, o.logprobs, o.prompt_logprobs)
    return final


def _recording(engine: LLMEngine) -> list:
    """Wrap the runner so that every step's batch shape is recorded."""
    seen, real = [], engine.runner.execute

    def execute(batch, *source):   # source: an overlapped step's device inputs (async scheduling)
        seen.append(dict(
            decodes=len(batch.decodes), prefill_lens=list(batch.num_new_tokens), seqs=len(batch.sequences),
            continued=[s.num_computed_tokens > 0 for s in batch.prefills],
            last_position=max([s.num_computed_tokens for s in batch.decodes]
                              + [s.num_computed_tokens + n - 1 for s, n in zip(batch.prefills, batch.num_new_tokens)]),
        ))
        return real(batch, *source)

    engine.runner.execute = execute
    return seen


def test_pools_come_back_empty_in_fresh_order_and_later_outputs_are_unchanged():
    plain, warmed = _engine(), _engine()
    seen = _recording(warmed)
    steps = warmed.warm_up()
    assert steps == len(seen) >= 20
    s = warmed.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0 and not warmed.has_unfinished_requests()
    assert s["steps"] == s["prompt_tokens"] == s["generation_tokens"] == 0     # not counted as served work
    # Later requests get the slots and blocks a fresh engine hands out.
    assert list(warmed.slots._free) == list(plain.slots._free)
    assert list(warmed.blocks._ids._free) == list(plain.blocks._ids._free)
    assert _run(warmed) == _run(plain)


def test_the_steps_cover_the_kernel_variants_within_the_limits():
    engine = _engine()
    seen = _recording(engine)
    engine.warm_up()
    prefill_only = [st for st in seen if not st["decodes"]]
    mixed = [st for st in seen if st["decodes"] and st["prefill_lens"]]
    decode_only = [st for st in seen if not st["prefill_lens"]]
    single = {st["prefill_lens"][0] for st in prefill_only if len(st["prefill_lens"]) == 1}
    assert {1, 16, 32, 64, 37} <= single                                # T == 1, T % 16 == 0, odd T
    assert any(len(set(st["prefill_lens"])) >= 3 for st in prefill_only)  # several lengths in one step
    assert any(any(st["continued"]) for st in seen)                      # a continuation chunk
    # Batch-size classes around each power of two up to max_num_seqs (32): 1, odd, p - 1, p, p + 1.
    assert {st["decodes"] for st in mixed} >= {1, 3, 15, 16, 17, 31}
    assert {st["decodes"] for st in decode_only} >= {1, 3, 15, 16, 31, 32}
    assert {len(st["prefill_lens"]) for st in prefill_only} >= {1, 3, 15, 16, 31, 32}
    assert CPU_TOKEN_CAP in {sum(st["prefill_lens"]) for st in prefill_only}   # the whole (capped) budget
    for st in seen:
        assert st["decodes"] + sum(st["prefill_lens"]) <= CPU_TOKEN_CAP and st["seqs"] <= 32


@pytest.mark.parametrize("limits", [dict(max_num_batched_tokens=7, max_num_seqs=2, max_model_len=20),
                                    dict(max_num_batched_tokens=7, max_num_seqs=12, max_model_len=20),
                                    dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=6),
                                    dict(max_num_batched_tokens=24, max_num_seqs=5, max_model_len=40, num_kv_blocks=4)])
def test_small_limits_are_respected_and_nothing_leaks(limits):
    engine = _engine(**limits)
    seen = _recording(engine)
    assert engine.warm_up() > 0
    budget, max_seqs = limits["max_num_batched_tokens"], limits["max_num_seqs"]
    for st in seen:
        assert st["decodes"] + sum(st["prefill_lens"]) <= budget and st["seqs"] <= max_seqs
        # As the engine: prompts < max_model_len, a sequence at max_model_len tokens is finished.
        assert st["last_position"] <= limits["max_model_len"] - 2
    assert engine.stats()["state_slots_used"] == 0 and engine.stats()["kv_blocks_used"] == 0
    engine.add_request("after", [65, 66], SamplingParams(max_tokens=3, ignore_eos=True))   # still serves
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_busy_engine_is_not_warmed_up():
    engine = _engine()
    engine.add_request("busy", [65], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warm_up()


def test_the_config_switch_and_the_cpu_default(monkeypatch):
    calls = []
    monkeypatch.setattr(llm_engine, "warm_up", lambda *a: calls.append(a) or 0)
    LLMEngine("tiny", max_model_len=64, device="cpu", kda_prefill_backend="reference", kda_decode_backend="reference")
    assert calls == []                      # CPU: nothing is compiled, nothing to warm up
    assert LLMEngine("tiny", max_model_len=64, device="cpu", kda_prefill_backend="reference",
                     kda_decode_backend="reference").config.warmup is True
    if torch.cuda.is_available():
        LLMEngine("tiny", max_model_len=64, device="cuda", warmup=False)
        assert calls == []
        LLMEngine("tiny", max_model_len=64, device="cuda")
        assert len(calls) == 1


def test_warm_up_refuses_pools_that_are_in_use():
    engine = _engine()
    slot = engine.slots.allocate()
    with pytest.raises(RuntimeError, match=r"1 state slot\(s\) .* in use: finish or abort"):
        warm_up(engine.runner, engine.slots, engine.blocks, engine.memory, vocab_size=engine.vocab_size,
                tokenizer=engine.tokenizer)
    engine.slots.free(slot)


def test_with_prefix_caching_the_checkpoint_kernels_are_warmed_and_nothing_is_cached():
    """With prefix caching on, the long prefills run again with in-launch checkpoints (the kernel
    variants a first long prompt would compile), as wide as the engine stages them; nothing ends
    up cached and later outputs are those of an engine without the warm-up."""
    plain, warmed = _engine(enable_prefix_caching=True), _engine(enable_prefix_caching=True)
    widths, real = [], warmed.runner.execute

    def execute(batch, *source):
        if batch.checkpoints:
            widths.append(batch.checkpoint_width)
            assert all(0 < o < n and o % 32 == 0 for pairs, n in zip(batch.checkpoints, batch.num_new_tokens)
                       for o, _ in pairs)
        return real(batch, *source)

    warmed.runner.execute = execute
    warmed.warm_up()
    assert widths and set(widths) == {4}   # the per-request cap (4)
    assert warmed.stats()["prefix_cache_states"] == 0
    assert _run(warmed) == _run(plain)
