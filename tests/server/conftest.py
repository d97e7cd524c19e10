"""One real server per way of running the engine for all server tests: the `tiny` model on CPU
(reference KDA backends), served by uvicorn on a free 127.0.0.1 port in a background thread."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import functools

from server_helpers import fail_step_when, make_engine, make_engine_process


@pytest.fixture(scope="session", params=["thread", "process"])
def server(request, tmp_path_factory):
    """Every server test runs against both ways of running the engine: a thread of the server's
    process (`--no-engine-process`) and a process of its own (kdaserve serve's default). The
    process runs with async scheduling, as `serve` does on a GPU (a CPU's default is off), so
    the API sees a step queued behind every decode step: outputs of two steps in one call,
    tokens of requests that ended dropped, aborts while a step is queued."""
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    fail_flag = tmp_path_factory.mktemp("engine") / "fail-next-step"
    if request.param == "process":
        engine = make_engine_process(setup=functools.partial(fail_step_when, flag=str(fail_flag)), async_scheduling=True)
    else:
        engine = make_engine()
    app = build_app(engine, max_queued_requests=256, enable_docs=True)   # the fuzzer reads /openapi.json
    with BackgroundServer(app) as srv:
        srv.app, srv.mode, srv.fail_flag = app, request.param, fail_flag
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
