"""One real server for all server tests: the `tiny` model on CPU (reference KDA backends), served by
uvicorn on a free 127.0.0.1 port in a background thread, stopped at the end of the session."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from server_helpers import make_engine


@pytest.fixture(scope="session")
def server():
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    app = build_app(make_engine(), max_queued_requests=256)
    with BackgroundServer(app) as srv:
        srv.app = app
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
