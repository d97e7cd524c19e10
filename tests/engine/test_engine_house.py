"""The engine's construction and what it shows: the pools are sized by the memory plan before the
runner exists (nothing is read back from the runner), EngineInfo is all a server reads of an
engine, and prefix caching turned off is a cache that finds and keeps nothing (one path)."""

import pickle

import pytest

from kdaserve.engine.llm_engine import LLMEngine
from kdaserve.engine.memory import plan_memory
from kdaserve.engine.prefix_cache import NoPrefixCache, PrefixCache
from kdaserve.engine.sampling_params import SamplingParams

KW = dict(device="cpu", max_model_len=64, max_num_seqs=3, max_num_batched_tokens=64, block_size=16, seed=0)


def test_the_pools_the_runner_and_the_info_agree_with_the_memory_plan():
    engine = LLMEngine("tiny", num_kv_blocks=20, prefix_cache_states=5, **KW)
    plan = engine.memory
    assert (plan.max_model_len, plan.num_running_slots, plan.num_checkpoint_slots, plan.num_kv_blocks) == (64, 4, 5, 20)
    assert engine.slots.capacity == plan.num_running_slots - 1   # the null slot is never handed out
    assert engine.blocks.capacity == plan.num_kv_blocks - 1      # nor the null block
    caches = engine.runner.caches
    assert caches.num_slots == plan.num_slots == 9 and caches.num_kv_blocks == 20
    assert all(conv.shape[0] == 9 for conv, _ in caches.kda)
    info = engine.info
    assert (info.num_kv_blocks, info.num_state_slots, info.max_model_len, info.max_num_seqs) == (20, 9, 64, 3)
    assert info.kda_backends == "reference+reference" and info.stop_ids == (engine.output.eos_token_id,)
    assert isinstance(engine.prefix_cache, PrefixCache)


def test_a_plan_with_too_few_blocks_says_what_one_sequence_needs():
    engine = LLMEngine("tiny", **KW)
    from kdaserve.engine.config import EngineConfig

    config = EngineConfig(model="tiny", num_kv_blocks=3, **KW)
    with pytest.raises(ValueError, match=r"num_kv_blocks=3 cannot hold one sequence of max_model_len=64 \(4 blocks of "
                                         r"16 \+ the null block\); expected >= 5"):
        plan_memory(config, engine.runner.model, 1024)


def test_engine_info_travels_to_another_process_whole():
    info = LLMEngine("tiny", **KW).info
    back = pickle.loads(pickle.dumps(info))
    assert (back.model_name, back.max_model_len, back.vocab_size, back.stop_ids, back.num_kv_blocks,
            back.num_state_slots) == (info.model_name, info.max_model_len, info.vocab_size, info.stop_ids,
                                      info.num_kv_blocks, info.num_state_slots)
    assert back.tokenizer.encode("héllo") == info.tokenizer.encode("héllo")


class _OnlyWhatTheServerMayRead:
    """An engine that answers only what a server may ask: its EngineInfo and the request and step
    calls the engine loop makes. Anything else the server reached for would raise here."""

    ALLOWED = {"info", "add_request", "abort_request", "step", "has_unfinished_requests", "stats", "compile_grammar",
               "last_step_tokens"}

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)

    def __getattr__(self, name):
        if name not in self.ALLOWED:
            raise AttributeError(f"the server read engine.{name}; it may read only EngineInfo and the loop's calls")
        return getattr(self._engine, name)


def test_the_server_reads_nothing_of_the_engine_but_its_info():
    fastapi = pytest.importorskip("fastapi.testclient")
    from kdaserve.server.app import build_app

    engine = _OnlyWhatTheServerMayRead(LLMEngine("tiny", **KW))
    with fastapi.TestClient(build_app(engine, enable_tokenizer_info_endpoint=True)) as http:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 64
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "temperature": 0}
        assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
        assert http.get("/metrics").status_code == 200 and http.get("/tokenizer_info").status_code == 200
        assert http.post("/detokenize", json={"tokens": [97, 98]}).json()["prompt"] == "ab"
    with pytest.raises(AttributeError, match="the server read engine.runner"):
        engine.runner


def test_prefix_caching_off_is_a_cache_that_finds_and_keeps_nothing():
    engine = LLMEngine("tiny", enable_prefix_caching=False, **KW)
    assert isinstance(engine.prefix_cache, NoPrefixCache) and engine.scheduler.prefix is engine.prefix_cache
    prompt = list(b"the same long prompt, twice over: the same long prompt")
    for i in range(2):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    stats = engine.stats()
    assert not any(k.startswith("prefix_cache") for k in stats) and engine.reset_prefix_cache() is False
    assert engine.counters["prompt_tokens"] == 2 * len(prompt)   # the second prompt computed again, whole
