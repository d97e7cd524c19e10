"""Helpers for the server tests: SSE parsing, Prometheus samples, request bodies."""

from __future__ import annotations

import json
import re

MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 16


def metric(text: str, name: str, **labels) -> float:
    """A sample's value from Prometheus text, 0 when absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        body = line[len(name):]
        if all(re.search(rf'{k}="{re.escape(str(v))}"', body) for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def sse_events(client, path: str, body: dict) -> list:
    """POST a streaming request; the parsed `data:` messages, "[DONE]" kept as the string."""
    events = []
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def greedy(**body) -> dict:
    """A deterministic completion request body: greedy, no early EOS."""
    return {"model": "tiny", "temperature": 0, "ignore_eos": True, **body}


ENGINE_KWARGS = dict(
    model="tiny",
    kda_prefill_backend="reference",
    kda_decode_backend="reference",
    max_num_seqs=MAX_NUM_SEQS,
    max_model_len=MAX_MODEL_LEN,
    device="cpu",
    enforce_eager=True,
    seed=0,
)


def make_engine():
    """The server tests' engine: the `tiny` model on the CPU, reference KDA backends."""
    from kdaserve.engine.llm_engine import LLMEngine

    return LLMEngine(**ENGINE_KWARGS)


def make_engine_process(setup=None, **overrides):
    """The same engine in its own process (kdaserve serve's default; engine/engine_process.py);
    `setup` runs on the engine there."""
    from kdaserve.engine.engine_process import EngineProcess

    return EngineProcess({**ENGINE_KWARGS, **overrides}, setup=setup)


def fail_step_when(engine, flag: str) -> None:
    """For an engine in its own process: its next step raises once the file `flag` exists (the
    file is removed), as a bug or a device error would."""
    import os

    step = engine.step

    def maybe_failing_step():
        if os.path.exists(flag):
            os.remove(flag)
            raise RuntimeError("injected step failure")
        return step()

    engine.step = maybe_failing_step
