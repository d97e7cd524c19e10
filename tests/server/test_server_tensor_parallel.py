"""The server on a split engine (kdaserve serve -tp 2, two CPU ranks over gloo): a completion and a
streamed chat answer as the one-rank engine's, also through two API servers' connections (a rank
that dies ending `kdaserve serve -tp 2`: tests/server/test_serve_command.py)."""

import json
import os

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from server_helpers import ENGINE_KWARGS, metric  # noqa: E402

from kdaserve.engine.engine_process import EngineProcess  # noqa: E402
from kdaserve.server.app import build_app  # noqa: E402

os.environ.setdefault("KDASERVE_COLLECTIVE_TIMEOUT_S", "60")
COMPLETION = {"model": "tiny", "prompt": "The engine splits", "max_tokens": 12, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Two ranks"}], "max_tokens": 10, "temperature": 0,
        "stream": True}


def _answers(engine) -> tuple[str, str, float]:
    """The completion's text, the streamed chat's, and /metrics' generated tokens after both."""
    with TestClient(build_app(engine)) as http:
        text = http.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
        with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        generated = metric(http.get("/metrics").text, "kdaserve:generation_tokens_total")
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, streamed, generated


def test_a_split_engine_serves_what_one_rank_serves():
    one = _answers(EngineProcess(dict(ENGINE_KWARGS)))
    two = EngineProcess(dict(ENGINE_KWARGS, tensor_parallel_size=2))
    assert not two.process.daemon   # it starts its rank: a daemon process may not
    assert _answers(two) == one and one[0] and one[1] and one[2] == 22   # /metrics counts the split engine's tokens


def test_two_api_servers_share_a_split_engine():
    """--api-server-count 2 over -tp 2: the split engine's process with two connections (one per API
    server; here two apps in this process, so their metrics are each their own): each answers as the
    one-rank engine, the second after the first has left."""
    one = _answers(EngineProcess(dict(ENGINE_KWARGS)))
    two = EngineProcess(dict(ENGINE_KWARGS, tensor_parallel_size=2), api_clients=2)
    clients = two.clients()
    try:
        for client in clients:
            with TestClient(build_app(client)) as http:
                text = http.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
            assert text == one[0]
    finally:
        two.close()
