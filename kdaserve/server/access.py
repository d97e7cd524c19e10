"""Who may call the server and with what: an ASGI middleware in front of every route.

- **API keys** (`--api-key`, or the VLLM_API_KEY / KDASERVE_API_KEY environment variable, as vLLM):
  `Authorization: Bearer <key>` is required on `/v1/*`, the tokenizer routes and `/openapi.json`, compared in
  constant time; otherwise 401.
- **Host check** (DNS rebinding): a server bound to a loopback address answers only requests whose
  Host header names loopback (or one of `--allowed-hosts`); otherwise 400. A web page a user visits
  cannot reach a local server through a name that resolves to 127.0.0.1.
- **JSON bodies only**: a POST must say `Content-Type: application/json` (415 otherwise), so a web
  page cannot post a "simple" cross-origin `text/plain` form to a local server.
- **Bounded bodies**: more than `--max-request-body-bytes` is refused with 413 as soon as the
  Content-Length or the bytes received pass it; nothing larger is ever buffered.
- `x-request-id` is echoed on the response.
Refusals are OpenAI-style JSON errors and close the connection; nothing reaches the engine.
"""

from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
API_KEY_ENV = ("VLLM_API_KEY", "KDASERVE_API_KEY")
PROTECTED_PREFIXES = ("/v1/",)
# /openapi.json maps every route and field; /docs and /redoc are static pages that fetch it.
PROTECTED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info", "/openapi.json")
DEFAULT_MAX_BODY_BYTES = 16 << 20   # a 1M-token prompt as JSON token ids is ~8 MB


@dataclass(frozen=True)
class AccessSettings:
    api_keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] | None = None   # None: no Host check (bound to a public address)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")

    @classmethod
    def for_server(cls, host: str, api_keys: list[str] | None = None, allowed_hosts: list[str] | None = None,
                   max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> "AccessSettings":
        """Keys from the flag, else the environment; the Host check on when bound to loopback
        (loopback names plus `allowed_hosts`), or when `allowed_hosts` are given."""
        keys = tuple(api_keys or ()) or tuple(v for v in (os.environ.get(e) for e in API_KEY_ENV) if v)
        hosts: tuple[str, ...] | None = None
        if host in LOOPBACK_HOSTS or host.startswith("127."):
            hosts = LOOPBACK_HOSTS + (host,) + tuple(allowed_hosts or ())
        elif allowed_hosts:
            hosts = tuple(allowed_hosts)
        return cls(keys, hosts, max_body_bytes)


def _host_name(value: str) -> str:
    """'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class AccessGuard:
    def __init__(self, app, settings: AccessSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        request_id = headers.get("x-request-id")
        s, path = self.settings, scope.get("path", "")
        if s.allowed_hosts is not None and _host_name(headers.get("host", "")) not in s.allowed_hosts:
            return await _refuse(send, 400, f"Host header {headers.get('host', '')!r} is not allowed: this server answers "
                                 f"{', '.join(s.allowed_hosts)} (add names with --allowed-hosts)", "host_not_allowed")
        # A CORS preflight (OPTIONS) carries no credentials by design; it reaches no route's work.
        if s.api_keys and scope.get("method") != "OPTIONS" and (path.startswith(PROTECTED_PREFIXES) or path in PROTECTED_PATHS):
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not any(hmac.compare_digest(token.encode(), k.encode()) for k in s.api_keys):
                return await _refuse(send, 401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                                     "invalid_api_key")
        if scope.get("method") == "POST":
            if headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
                return await _refuse(send, 415, f"request bodies must be JSON (Content-Type: application/json), got "
                                     f"{headers.get('content-type') or 'no Content-Type'}", "unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and not length.isdigit():
                return await _refuse(send, 400, f"Content-Length {length!r} is not a byte count", "invalid_content_length")
            if length is not None and int(length) > s.max_body_bytes:
                return await _refuse(send, 413, f"request body of {length} bytes exceeds the limit of {s.max_body_bytes} "
                                     f"bytes (--max-request-body-bytes)", "request_too_large")
            body, too_large = await _read_body(receive, s.max_body_bytes)
            if too_large:
                return await _refuse(send, 413, f"request body exceeds the limit of {s.max_body_bytes} bytes "
                                     f"(--max-request-body-bytes)", "request_too_large")
            receive = _replay(body, receive)
        if request_id is not None:
            send = _with_header(send, b"x-request-id", request_id.encode("latin-1"))
        return await self.app(scope, receive, send)


async def _read_body(receive, limit: int) -> tuple[bytes, bool]:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()   # later: disconnects

    return replay


def _with_header(send, name: bytes, value: bytes):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return wrapped


async def _refuse(send, status: int, message: str, code: str) -> None:
    from kdaserve.server.errors import error_body

    payload = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
