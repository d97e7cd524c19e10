"""Idle and slowloris connections are closed after the header timeout; a server holding hundreds
of them still answers /health at once; well-behaved keep-alive clients are unaffected."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from kdaserve.server.launch import BackgroundServer, raise_open_file_limit


@pytest.fixture(scope="module", params=["h11", "httptools"])
def guarded(request):
    """Both of uvicorn's HTTP protocols: the header deadline hooks into each."""
    from server_helpers import make_engine

    from kdaserve.server.app import build_app

    if request.param == "httptools":
        pytest.importorskip("httptools")
    raise_open_file_limit()
    with BackgroundServer(build_app(make_engine()), header_timeout=0.5, http=request.param) as srv:
        base = srv.server.config.http_protocol_class.__mro__[1].__name__   # HeaderDeadline<base> over uvicorn's
        assert base == {"h11": "H11Protocol", "httptools": "HttpToolsProtocol"}[request.param]
        yield srv


def _connect(srv) -> socket.socket:
    s = socket.create_connection((srv.host, srv.port))
    s.settimeout(5)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closes `s` within `seconds` (recv returns b"" or the reset arrives)."""
    s.settimeout(seconds)
    try:
        while True:
            if s.recv(4096) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_silent_and_trickling_connections_are_closed(guarded):
    silent = _connect(guarded)
    trickle = _connect(guarded)
    t0 = time.monotonic()
    for byte in b"GET /health HTTP/1.1\r\nHost: 127":      # headers a byte at a time, never finished
        trickle.sendall(bytes([byte]))
        time.sleep(0.02)
        if time.monotonic() - t0 > 0.4:
            break
    assert _closed_within(silent, 3) and _closed_within(trickle, 3)
    assert time.monotonic() - t0 < 3


def test_keep_alive_clients_are_unaffected_and_health_answers_next_to_hundreds_of_idle_connections(guarded):
    idle = [_connect(guarded) for _ in range(300)]
    slow = [_connect(guarded) for _ in range(50)]
    for s in slow:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    try:
        with httpx.Client(base_url=guarded.url, timeout=5) as client:
            for _ in range(3):                               # one connection, several requests apart in time
                t0 = time.monotonic()
                assert client.get("/health").status_code == 200
                assert time.monotonic() - t0 < 0.5
                time.sleep(0.3)
        assert all(_closed_within(s, 3) for s in idle[:20] + slow[:20])
    finally:
        for s in idle + slow:
            s.close()


def test_timeouts_that_are_not_positive_are_refused():
    from server_helpers import make_engine

    from kdaserve.server.app import build_app
    from kdaserve.server.connections import header_timeout_protocol

    with pytest.raises(ValueError, match="invalid header timeout: got 0; expected seconds > 0"):
        header_timeout_protocol(0)
    with pytest.raises(ValueError, match=r"invalid stream_write_timeout: got -1\.0; expected seconds > 0"):
        build_app(make_engine(), stream_write_timeout=-1.0)


def test_an_unknown_http_protocol_is_refused_with_the_names_that_exist():
    from kdaserve.server.connections import http_protocol

    with pytest.raises(ValueError, match="invalid HTTP protocol 'h2'; expected auto, h11 or httptools"):
        http_protocol("h2")
