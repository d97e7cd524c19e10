"""The engine in its own process (engine/engine_process.py): outputs cross the pipe as deltas and
come back equal to the engine's own; a dead engine process fails its requests and /health instead of
hanging them; startup errors reach the caller; closing stops the process. (Every other server test
runs against both ways of running the engine: conftest.py.)"""

from __future__ import annotations

import pickle
import time

import httpx
import pytest
from server_helpers import ENGINE_KWARGS, greedy, make_engine_process

from kdaserve.engine import LLMEngine, RequestOutput, SamplingParams
from kdaserve.engine.engine_process import EngineProcess
from kdaserve.engine.output_wire import OutputDecoder, OutputEncoder
from kdaserve.engine.outputs import ListPrefix


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


def _run(engine, requests: list, abort_at: dict) -> list[RequestOutput]:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    outs, steps = [], 0
    while engine.has_unfinished_requests():
        outs += engine.step()
        steps += 1
        for request_id in abort_at.get(steps, ()):
            engine.abort_request(request_id)
    return outs


def test_text_the_engine_process_leaves_to_the_api_process_is_the_engines_own():
    """The engine process makes text only for requests with stop strings (OutputProcessor.detokenize
    off); the API process's decoder detokenizes the others. Every output (text included) equals
    the output of an engine that makes all text: random bytes (characters cut in half, held back
    and flushed at the end), a stop token left out of the text, several tokens per output
    (--stream-interval), an abort holding tokens back, a stop string, log-probs."""
    probe = LLMEngine(**ENGINE_KWARGS)
    prompt = list(b"Text made elsewhere")
    first = _run(probe, [("p", prompt, SamplingParams(max_tokens=12, ignore_eos=True))], {})[-1].output_token_ids
    stop_text = probe.tokenizer.decode(first[5:7])
    requests = [
        ("plain", prompt, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)),
        ("sampled", list(b"Random bytes"), SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=3)),
        ("stop-token", prompt, SamplingParams(max_tokens=12, stop_token_ids=[first[4]])),
        ("interval", list(b"Held back"), SamplingParams(max_tokens=11, ignore_eos=True, temperature=1.0, seed=5,
                                                          stream_interval=3)),
        ("aborted", list(b"Cut short"), SamplingParams(max_tokens=50, ignore_eos=True, temperature=1.0, seed=7,
                                                         stream_interval=4)),
        ("stop-string", prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop_text])),
    ]
    abort_at = {6: ["aborted"]}
    reference = _run(LLMEngine(**ENGINE_KWARGS), requests, abort_at)
    engine = LLMEngine(**ENGINE_KWARGS)
    engine.output.detokenize = False
    made = _run(engine, requests, abort_at)
    assert [o.text is None for o in made] == [o.request_id != "stop-string" for o in made]   # left to the decoder
    encoder, decoder = OutputEncoder(), OutputDecoder(engine.tokenizer)
    for request_id, ids, _ in requests:
        decoder.begin(request_id, ids)
    back = [decoder.decode(w) for w in pickle.loads(pickle.dumps([encoder.encode(o) for o in made]))]
    reasons = {o.request_id: o.finish_reason for o in reference if o.finished}
    assert reasons == {"plain": "length", "sampled": "length", "stop-token": "stop", "interval": "length",
                       "aborted": "abort", "stop-string": "stop"}
    # Characters cut in half by an output's last token were held back (and later flushed).
    assert any(not o.finished and o.text != engine.tokenizer.decode(o.output_token_ids) for o in reference)
    fields = [f for f in RequestOutput._FIELDS if f != "metrics"]   # times differ between two engines
    for b, r in zip(back, reference, strict=True):
        assert [getattr(b, f) for f in fields] == [getattr(r, f) for f in fields], r.request_id
    assert [b.metrics for b in back] == [m.metrics for m in made]


def test_api_side_text_with_a_checkpoints_tokenizer():
    """The same through a released checkpoint's tokenizer (the shipped nano model: tokenizer.json,
    DecodeStream) as the API process holds it, a pickled copy: byte-level merges, a non-ASCII
    prompt, several tokens per output."""
    kwargs = {**ENGINE_KWARGS, "model": "nano", "max_model_len": 256}
    requests = [("g", "def main():\n    print(", SamplingParams(max_tokens=30)),
                ("u", "Unicode: h\u00e9llo w\u00f6rld \u2014 ", SamplingParams(max_tokens=40, temperature=1.0, seed=1,
                                                                        stream_interval=3))]
    reference_engine = LLMEngine(**kwargs)
    requests = [(r, reference_engine.tokenizer.encode(text), params) for r, text, params in requests]
    reference = _run(reference_engine, requests, {})
    engine = LLMEngine(**kwargs)
    engine.output.detokenize = False
    encoder, decoder = OutputEncoder(), OutputDecoder(pickle.loads(pickle.dumps(engine.tokenizer)))
    for request_id, ids, _ in requests:
        decoder.begin(request_id, ids)
    back = [decoder.decode(w) for w in pickle.loads(pickle.dumps([encoder.encode(o) for o in _run(engine, requests, {})]))]
    assert any(len(o.new_token_ids) > 1 for o in reference) and all(o.text for o in reference if o.finished)
    assert [(b.request_id, b.text, b.output_token_ids) for b in back] == [(r.request_id, r.text, r.output_token_ids)
                                                                          for r in reference]


def test_text_that_shrinks_when_a_stop_string_completes():
    made = [RequestOutput("s", [1], [5], [5], "ab", False), RequestOutput("s", [1], [5, 6], [6], "ab<st", False),
            RequestOutput("s", [1], [5, 6, 7], [7], "ab", True, "stop")]
    assert [o.text for o in roundtrip(made, {"s": [1]})] == ["ab", "ab<st", "ab"]
    assert roundtrip(made, {"s": [1]}) == made


def test_an_output_without_text_needs_a_decoder_with_the_tokenizer():
    decoder = OutputDecoder()
    decoder.begin("t", [1])
    with pytest.raises(ValueError, match=r"request 't'.*without text.*OutputDecoder\(tokenizer\)"):
        decoder.decode(OutputEncoder().encode(RequestOutput("t", [1], [5], [5], None, False)))


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

    engine = SimpleNamespace(info=SimpleNamespace(max_num_seqs=4, tokenizer=None))   # what a loop reads (EngineInfo)

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
