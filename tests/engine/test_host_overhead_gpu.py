"""The engine's host side on a GPU: metadata staged through pinned buffers (one non-blocking copy),
CUDA-graph decode equal to eager decode as batch sizes change step by step, one device->host
synchronization per decode step (the sampled tokens), and the startup warm-up.
Run: pytest -q tests/engine/test_host_overhead_gpu.py (skipped without a GPU)."""

import logging
import re
import warnings

import pytest
import torch

from kdaserve.engine import LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu


class TritonCompiles:
    """Kernel specializations Triton compiles (or loads from its disk cache) in this process while
    the block runs: each is a first-request stall the warm-up should have taken."""

    def __enter__(self):
        from triton import knobs

        self.names, self._knobs = [], knobs.runtime
        self._before = knobs.runtime.jit_post_compile_hook
        # The whole specialization on one line (the repr spans lines): which argument differed.
        knobs.runtime.jit_post_compile_hook = lambda **kw: self.names.append(" ".join(str(kw["repr"]).split())) and None
        return self

    def __exit__(self, *exc):
        self._knobs.jit_post_compile_hook = self._before


def _tiny(decode="chain", **kw) -> LLMEngine:
    # fp32 keeps greedy comparisons free of bf16 rounding flips.
    kw = {"max_num_seqs": 16, "max_model_len": 256, "kda_prefill_backend": "flash", "kda_decode_backend": decode, **kw}
    return LLMEngine("tiny", device="cuda", dtype="float32", **kw)


def _arrivals(engine: LLMEngine, count: int = 13) -> dict:
    """One new request per step while the earlier ones decode, each with its own length: decode
    batches grow 1, 2, ..., then shrink as requests finish (sizes between the graph buckets, so
    padding rows, and mixed steps all along)."""
    final, step = {}, 0
    while step < count or engine.has_unfinished_requests():
        if step < count:
            prompt = [(11 * step + j) % 200 + 1 for j in range(3 + 5 * step)]
            lp = 2 if step % 4 == 0 else None
            engine.add_request(f"r{step}", prompt, SamplingParams(max_tokens=6 + 3 * step, ignore_eos=True, logprobs=lp))
        for o in engine.step():
            if o.finished:
                final[o.request_id] = (o.output_token_ids, o.logprobs)
        step += 1
    return final


@pytest.mark.parametrize("decode", ["chain", "fused"])
def test_graph_decode_with_staged_inputs_equals_eager_as_batch_sizes_change(decode):
    eager, graphs = _tiny(decode, enforce_eager=True), _tiny(decode)
    assert graphs.runner.graphs is not None and graphs.runner.step_ring.pinned
    replayed = []
    real_run = graphs.runner.graphs.run
    graphs.runner.graphs.run = lambda step, *source: replayed.append(step.num_decodes) or real_run(step, *source)
    want, got = _arrivals(eager), _arrivals(graphs)
    assert len(set(replayed)) >= 8, replayed          # many batch sizes went through the graphs
    assert set(got) == set(want)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        if want[rid][1] is not None:
            for a, b in zip(got[rid][1], want[rid][1]):
                assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    s = graphs.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "one_at_a_time"])
@pytest.mark.parametrize("eager", [False, True])
def test_a_decode_step_never_synchronizes_the_stream(eager, async_scheduling):
    """Only the sampled tokens' transfer is waited for, on its own event (sampler.PendingSample):
    no stream or device synchronization, no blocking copy (torch's sync debug mode reports each)."""
    engine = _tiny(enforce_eager=eager, async_scheduling=async_scheduling)
    for i in range(5):
        engine.add_request(f"r{i}", [5 + i] * (4 + i), SamplingParams(max_tokens=40, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()):
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == []
    assert (engine.counters["overlapped_steps"] >= 4) == async_scheduling


def test_warm_up_runs_at_startup_and_changes_nothing(caplog):
    plain = _tiny(warmup=False)
    with caplog.at_level(logging.INFO, logger="kdaserve.engine"):
        warmed = _tiny()
    assert any(re.match(r"warm-up: \d+ steps", r.getMessage()) for r in caplog.records), caplog.text
    s = warmed.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0 and s["steps"] == 0
    requests = [
        ("g", list(range(1, 30)), SamplingParams(max_tokens=12, ignore_eos=True)),
        ("t", list(range(40, 47)), SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)),   # global generator
    ]

    def run(engine):
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        out = {}
        while engine.has_unfinished_requests():
            out.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
        return out

    assert run(warmed) == run(plain)


def test_bench_model_after_the_warm_up_a_bench_run_compiles_nothing():
    """What bench_throughput.py measured: a fresh process's first run of 1024-token prompts was 3x
    slower than later runs, Triton compiling kernel variants inside the run. After the warm-up
    such a run compiles nothing (on failure the message names the variants it missed)."""
    engine = LLMEngine("bench", max_num_seqs=32, max_model_len=1024 + 64 + 64, max_num_batched_tokens=4096)
    assert engine.runner.graphs is not None
    s = engine.stats()
    assert s["state_slots_used"] == 0 and s["kv_blocks_used"] == 0
    g = torch.Generator().manual_seed(0)
    with TritonCompiles() as compiled:
        for i, prompt in enumerate(torch.randint(0, 256, (40, 1024), generator=g).tolist()):
            engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=64, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
    assert compiled.names == [], "compiled after the warm-up:\n" + "\n".join(compiled.names)


@pytest.mark.parametrize("pair", [("flash", "chain"), ("flash", "fused")])
def test_after_the_warm_up_a_served_workload_compiles_nothing(pair):
    """Requests of assorted lengths arriving while others decode (prefill, mixed and decode steps
    of many sizes): every kernel variant they need was compiled by the warm-up."""
    import random

    engine = LLMEngine("tiny", device="cuda", max_num_seqs=32, max_model_len=512, max_num_batched_tokens=512,
                       kda_prefill_backend=pair[0], kda_decode_backend=pair[1])
    rng = random.Random(0)
    with TritonCompiles() as compiled:
        for i in range(40):
            if i < 30:
                for j in range(rng.choice([0, 1, 3])):
                    prompt = [rng.randrange(1, 200) for _ in range(rng.choice([1, 2, 7, 16, 33, 64, 100, 257]))]
                    engine.add_request(f"r{i}-{j}", prompt, SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True))
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
    assert compiled.names == [], "compiled after the warm-up:\n" + "\n".join(compiled.names)
