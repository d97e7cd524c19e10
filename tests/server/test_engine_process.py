"""The engine in its own process (server/engine_process.py): outputs cross the pipe as deltas and
come back equal to the engine's own; a dead engine process fails its requests and /health instead of
hanging them; startup errors reach the caller; closing stops the process. (Every other server test
runs against both ways of running the engine: conftest.py.)"""

from __future__ import annotations

import pickle
import time

import httpx
import pytest

from kdaserve.engine import LLMEngine, RequestOutput, SamplingParams
from kdaserve.engine.outputs import ListPrefix
from kdaserve.server.engine_process import EngineProcess
from kdaserve.server.output_wire import OutputDecoder, OutputEncoder
from server_helpers import ENGINE_KWARGS, greedy, make_engine_process


def roundtrip(outputs: list[RequestOutput], prompts: dict) -> list[RequestOutput]:
    encoder, decoder = OutputEncoder(), OutputDecoder()
    for request_id, ids in prompts.items():
        decoder.begin(request_id, ids)
    # through pickle, as the pipe sends them, each read only after all were made
    return [decoder.decode(w) for w in pickle.loads(pickle.dumps([encoder.encode(o) for o in outputs]))]


def test_outputs_cross_as_deltas_and_come_back_equal():
    engine = LLMEngine(**ENGINE_KWARGS)
    prompts = {"a": list(b"Deltas of a stream"), "b": list(b"Another one"), "c": list(b"Aborted")}
    engine.add_request("a", prompts["a"], SamplingParams(max_tokens=7, ignore_eos=True, logprobs=2, prompt_logprobs=1))
    engine.add_request("b", prompts["b"], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("c", prompts["c"], SamplingParams(max_tokens=50, ignore_eos=True, logprobs=0))
    outs, steps = [], 0
    while engine.has_unfinished_requests():
        outs += engine.step()
        steps += 1
        if steps == 3:
            engine.abort_request("c")
    assert {o.finish_reason for o in outs if o.finished} == {"length", "abort"}
    back = roundtrip(outs, prompts)
    assert all(type(b._output_token_ids) is ListPrefix for b in back)   # snapshots, read lazily (then compared)
    assert back == outs


def test_text_that_shrinks_when_a_stop_string_completes():
    made = [RequestOutput("s", [1], [5], [5], "ab", False), RequestOutput("s", [1], [5, 6], [6], "ab<st", False),
            RequestOutput("s", [1], [5, 6, 7], [7], "ab", True, "stop")]
    assert [o.text for o in roundtrip(made, {"s": [1]})] == ["ab", "ab<st", "ab"]
    assert roundtrip(made, {"s": [1]}) == made


def test_a_request_not_begun_is_dropped():
    out = RequestOutput("x", [1], [2], [2], "t", False)
    assert OutputDecoder().decode(OutputEncoder().encode(out)) is None


def test_startup_errors_reach_the_caller():
    with pytest.raises(RuntimeError, match="no-such-model"):
        EngineProcess({**ENGINE_KWARGS, "model": "no-such-model"})


def test_a_dead_engine_process_fails_its_requests_and_health():
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    engine = make_engine_process()
    with BackgroundServer(build_app(engine)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=greedy(prompt="Hi", max_tokens=2)).status_code == 200
        body = {**greedy(prompt="A long one", max_tokens=900), "stream": True}
        events = []
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        engine.process.kill()   # a device error, the OOM killer
                    events.append(line[6:])
        assert events[-1] == "[DONE]" and "the engine stopped" in events[-2], events[-3:]
        assert client.get("/health").status_code == 503
        late = client.post("/v1/completions", json=greedy(prompt="Hi", max_tokens=2))
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unavailable"


def test_closing_the_app_stops_the_engine_process():
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    engine = make_engine_process()
    with BackgroundServer(build_app(engine)) as srv:
        assert httpx.post(f"{srv.url}/v1/completions", json=greedy(prompt="Hi", max_tokens=2), timeout=60).status_code == 200
    deadline = time.monotonic() + 30
    while engine.process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.process.exitcode == 0


def test_a_request_posted_as_the_engine_process_ends_gets_an_error_not_silence():
    """The reader fails every member when the engine process ends; a request that passed the
    liveness check just before must not register after that and wait forever."""
    import asyncio
    from types import SimpleNamespace

    from kdaserve.server.engine_loop import ProcessEngineLoop, RequestGroup, _Add

    engine = SimpleNamespace(max_num_seqs=4)

    async def run():
        loop = ProcessEngineLoop(engine)
        loop._stopping, loop.last_error = True, "the engine process exited (exit code -9)"
        group = RequestGroup(loop, ["a"], asyncio.get_running_loop())
        loop._post(_Add("a", [1, 2], SamplingParams(), group, 0))
        try:
            await asyncio.wait_for(group.next(), 5)
        except Exception as exc:  # noqa: BLE001
            return exc, loop._members

    error, members = asyncio.run(run())
    assert error.status == 503 and "exit code -9" in error.message and not members
