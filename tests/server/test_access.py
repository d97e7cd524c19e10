"""The access layer (kdaserve/server/access.py) on a real socket: API keys, the loopback Host check,
JSON-only bodies, the body-size limit (the server keeps answering others meanwhile), x-request-id,
Retry-After, the served name in /v1/models, /ping, and /docs off by default."""

from __future__ import annotations

import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from kdaserve.server.access import AccessSettings


@pytest.fixture(scope="module")
def guarded():
    """A second server over the same kind of engine, with a key, the loopback Host check and a
    small body limit."""
    from server_helpers import make_engine

    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    access = AccessSettings.for_server("127.0.0.1", ["sekrit-1", "sekrit-2"], ["kdaserve.internal"], max_body_bytes=4096)
    app = build_app(make_engine(), served_model_name="tiny", model_root="/secret/path/to/tiny", access=access)
    with BackgroundServer(app) as srv:
        yield srv


KEY = {"Authorization": "Bearer sekrit-2"}
BODY = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0}


def test_api_key_is_required_on_v1_and_tokenizer_routes(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        for path in ("/v1/completions", "/tokenize"):
            r = c.post(path, json=BODY)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert c.post(path, json=BODY, headers={"Authorization": "Bearer sekrit-3"}).status_code == 401
        assert c.post("/v1/completions", json=BODY, headers=KEY).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "bearer sekrit-1"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/ping").status_code == 200   # probes need no key


def test_host_header_must_name_loopback_or_an_allowed_host(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        r = c.get("/health", headers={"Host": "attacker.example:8000"})
        assert r.status_code == 400 and "not allowed" in r.json()["error"]["message"]
        assert r.headers.get("connection") == "close"
        for host in ("localhost:1234", "127.0.0.1", "[::1]:80", "kdaserve.internal"):
            assert c.get("/health", headers={"Host": host}).status_code == 200, host


def test_only_json_bodies_are_accepted(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        r = c.post("/v1/completions", content=b'{"prompt": "x"}', headers={**KEY, "Content-Type": "text/plain"})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
        r = c.post("/v1/completions", content=b'{"prompt": "x"}', headers={**KEY, "Content-Type": ""})
        assert r.status_code == 415


def test_a_body_over_the_limit_gets_413_and_others_are_served_meanwhile(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        big = {**BODY, "prompt": "x" * 10_000}
        r = c.post("/v1/completions", json=big, headers=KEY)
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    # A chunked upload without Content-Length that never ends: refused once 4096 bytes arrived,
    # while /health keeps answering fast.
    host, port = guarded.host, guarded.port
    sock = socket.create_connection((host, port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sekrit-1\r\n"
                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    stop = threading.Event()

    def trickle():
        try:
            while not stop.is_set():
                sock.sendall(b"400\r\n" + b"x" * 1024 + b"\r\n")
                time.sleep(0.01)
        except OSError:
            pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    with httpx.Client(base_url=guarded.url, timeout=5) as c:
        start = time.monotonic()
        assert c.get("/health").status_code == 200
        assert time.monotonic() - start < 1.0
    sock.settimeout(10)
    reply = sock.recv(4096)
    stop.set()
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]


def test_request_id_is_echoed_and_models_shows_the_served_name(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        r = c.get("/v1/models", headers={**KEY, "x-request-id": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123"
        assert "/secret/path" not in r.text and r.json()["data"][0]["root"] == "tiny"
        assert c.post("/v1/completions", json={**BODY, "model": "/secret/path/to/tiny"}, headers=KEY).status_code == 200
        assert c.get("/docs", headers=KEY).status_code == 404 and c.get("/openapi.json", headers=KEY).status_code == 404


def test_the_schema_and_docs_are_served_only_when_enabled_and_behind_the_key():
    from server_helpers import make_engine

    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    access = AccessSettings.for_server("127.0.0.1", ["sekrit-1"])
    with BackgroundServer(build_app(make_engine(), access=access, enable_docs=True)) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/openapi.json").status_code == 401
            assert c.get("/openapi.json", headers={"Authorization": "Bearer sekrit-1"}).status_code == 200
            assert c.get("/docs").status_code == 200   # a static page; the schema it fetches needs the key


def test_503_says_when_to_retry():
    from kdaserve.server.errors import error_response

    r = error_response(503, "busy")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_settings_from_the_environment_and_the_bind_address(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    s = AccessSettings.for_server("0.0.0.0")
    assert s.api_keys == ("from-env",) and s.allowed_hosts is None          # public bind: no Host check
    assert AccessSettings.for_server("0.0.0.0", allowed_hosts=["a.example"]).allowed_hosts == ("a.example",)
    assert "localhost" in AccessSettings.for_server("127.0.0.1").allowed_hosts
    with pytest.raises(ValueError, match="must not be empty"):
        AccessSettings(api_keys=("",))


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    import resource

    from kdaserve.server.launch import raise_open_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        got = raise_open_file_limit()
        assert got == resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_request_id_headers_make_the_client_id_the_response_id():
    """With --enable-request-id-headers a client's X-Request-Id is the completion's id; two
    requests with the same header still run (the engine's ids stay unique)."""
    from server_helpers import make_engine

    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    with BackgroundServer(build_app(make_engine(), request_id_headers=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
        for _ in range(2):
            r = c.post("/v1/completions", json=body, headers={"x-request-id": "req-7"})
            assert r.status_code == 200 and r.json()["id"] == "req-7" and r.headers["x-request-id"] == "req-7"
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=chat, headers={"x-request-id": "c-1"}).json()["id"] == "c-1"
        assert c.post("/v1/completions", json=body).json()["id"].startswith("cmpl-")


def test_a_chat_template_override_renders_in_the_sandbox():
    from kdaserve.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}>{% endif %}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n>"
    tok.chat_template = "{{ messages.__class__.__mro__ }}"          # the sandbox refuses attribute escapes
    with pytest.raises(Exception, match="unsafe|not safely"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
