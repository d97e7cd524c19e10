"""Running the app under uvicorn: in the foreground (`kdaserve serve`) or in a background thread
(tests, benchmarks), on a real socket either way."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from kdaserve.server.connections import DEFAULT_HEADER_TIMEOUT, DEFAULT_SEND_BUFFER_BYTES, header_timeout_protocol, http_protocol


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def uvicorn_config(app, host: str, port: int, log_level: str = "info", *,
                   header_timeout: float = DEFAULT_HEADER_TIMEOUT, send_buffer_bytes: int = DEFAULT_SEND_BUFFER_BYTES,
                   http: str = "auto", **options) -> uvicorn.Config:
    """`options`: uvicorn's own (root_path, ssl_keyfile, ssl_certfile, timeout_keep_alive,
    limit_concurrency, loop, ...); `header_timeout`, `send_buffer_bytes`: server/connections.py; `http`: uvicorn's
    protocol name (auto: httptools when installed, the `serve` extra's choice: it parses and frames
    a stream's chunks with less Python than h11)."""
    # timeout_graceful_shutdown: open streams must not hold a shutdown forever.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          http=header_timeout_protocol(header_timeout, http_protocol(http), send_buffer_bytes),
                          **options)


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (as vLLM does): every connection holds a
    descriptor, and at the default 1024 a burst of clients exhausts them. Returns the soft limit."""
    try:
        import resource
    except ImportError:   # not on this platform
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def serve_forever(app, host: str, port: int, log_level: str = "info", **options) -> str | None:
    """Serve until Ctrl-C / SIGTERM (None) or until the engine stops on its own (its error):
    uvicorn drains in-flight requests either way, and a signal ends here quietly instead of in a
    KeyboardInterrupt traceback."""
    raise_open_file_limit()
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level, **options))
    engine_error = []

    def on_engine_exit(error: str | None) -> None:
        engine_error.append(error or "the engine stopped")
        server.should_exit = True

    app.state.server.engine_loop.on_engine_exit = on_engine_exit
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return engine_error[0] if engine_error else None


class BackgroundServer:
    """`with BackgroundServer(app) as srv: ... srv.url ...`: uvicorn in a thread, stopped on exit."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning", **options):
        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, log_level, **options))
        self.thread = threading.Thread(target=self.server.run, name="kdaserve-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
