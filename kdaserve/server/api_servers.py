"""Several API server processes in front of one engine process (vLLM's `--api-server-count`).

Why: with the engine in its own process, the API process is what bounds inter-token latency at
many streams: every stream costs one SSE chunk per step of Python (the completion handler, JSON,
Starlette's send path, the socket write), ~30-40 µs of CPU on the H200's host, so 64 streams need
more than a decode step of one interpreter (docs/perf-notes.md). N processes split the streams.

How: this (the parent) process starts the engine process with N connections
(engine_process.EngineProcess(api_clients=N)), binds a listening socket per API server process on
the one port (SO_REUSEPORT: the kernel spreads the connections) and spawns the N processes; each runs
the same app (app.build_app with `api_server=(i, N)`) on its own connection to the engine. The
parent then only watches: if any of them exits unexpectedly it stops the rest (a server that half
works is worse than one that is down: a supervisor restarts it whole). Ctrl-C or SIGTERM drains
the API servers (uvicorn's graceful shutdown), then stops the engine.

Metrics: prometheus_client's multiprocess mode in a temporary directory (server/metrics.py),
removed on exit. Limits per process: `--max-num-seqs + --max-queued-requests` split evenly.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time

logger = logging.getLogger("kdaserve.server")
# Seconds the API servers get to drain their streams on shutdown before they are killed.
DRAIN_TIMEOUT = 15.0


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """A listening socket per API server process, all on one port (SO_REUSEPORT: the kernel
    spreads new connections over them by their addresses' hash). One socket shared by all would
    hand a burst of connections to whichever process wakes first: asyncio accepts up to its
    backlog per wake-up, so 64 streams opened at once can all land on one process. Where the
    platform lacks SO_REUSEPORT, one shared socket."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    sockets = []
    try:
        for _ in range(count if reuse_port is not None else 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port is not None:
                sock.setsockopt(socket.SOL_SOCKET, reuse_port, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]   # port 0: the others take the one the first got
            sock.listen(2048)
            sock.set_inheritable(True)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sockets * count if len(sockets) == 1 else sockets


METRICS_DIR_PREFIX = "kdaserve-metrics-"


def sweep_stale_metrics_dirs(root: str) -> list[str]:
    """Remove the metrics directories (`kdaserve-metrics-<pid>-*`) of servers whose process is
    gone: a server stopped cleanly removes its own, one killed (SIGKILL, a crash) cannot. A
    directory whose pid is alive (even another program that reused it), or that is not ours to
    remove, stays. Returns the ones removed."""
    removed = []
    for name in os.listdir(root):
        if not name.startswith(METRICS_DIR_PREFIX):
            continue
        pid = name[len(METRICS_DIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(root, name)
        if not pid.isdigit() or not os.path.isdir(path) or _alive(int(pid)):
            continue
        try:
            shutil.rmtree(path)
            removed.append(path)
        except OSError:   # another user's, or removed meanwhile
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process
        return True
    return True


class APIServers:
    """`APIServers(engine, count, app_kwargs, host, port, uvicorn_options)`: spawns the API server
    processes on `engine`'s connections (an EngineProcess made with `api_clients=count`); `wait()`
    blocks until Ctrl-C / SIGTERM or until one of them (or the engine) exits; `stop()` drains and
    stops all, the engine last. Also usable from a benchmark: `url`, then `stop()`."""

    def __init__(self, engine, count: int, app_kwargs: dict, host: str, port: int, *, log_level: str = "info",
                 uvicorn_options: dict | None = None):
        clients = engine.clients()
        if len(clients) != count:
            raise ValueError(f"the engine process has {len(clients)} connections for {count} API servers")
        self.engine, self.host = engine, host
        self.sockets = bind_sockets(host, port, count)
        self.port = self.sockets[0].getsockname()[1]
        sweep_stale_metrics_dirs(tempfile.gettempdir())
        self._metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
        # Read by prometheus_client when it is first imported, in each spawned process.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir
        ctx = mp.get_context("spawn")
        self._ready = [ctx.Event() for _ in range(count)]
        self.processes = [ctx.Process(target=_api_server_main, name=f"kdaserve-api-server-{i}", daemon=False,
                                      args=(i, count, clients[i], app_kwargs, self.sockets[i], host, self.port, log_level,
                                            dict(uvicorn_options or {}), self._ready[i]))
                          for i in range(count)]
        for p in self.processes:
            p.start()
        logger.info("%d API server processes starting on %s (one engine process)", count, self.url)

    def wait_ready(self, timeout: float = 300.0) -> bool:
        """Until every API server process accepts connections (True), or one exited or `timeout`
        passed (False). Until then a connection the kernel gives to one not yet up waits in its
        socket's backlog."""
        deadline = time.monotonic() + timeout
        for p, ready in zip(self.processes, self._ready):
            while not ready.wait(0.1):
                if not p.is_alive() or time.monotonic() > deadline:
                    return False
        logger.info("%d API server processes ready on %s", len(self.processes), self.url)
        return True

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait(self) -> int:
        """Until Ctrl-C / SIGTERM (0) or until an API server or the engine exits on its own (1)."""
        def on_signal(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, on_signal)
        try:
            self.wait_ready()
            sentinels = {p.sentinel: p.name for p in self.processes}
            sentinels[self.engine.process.sentinel] = "the engine process"
            ready = mp.connection.wait(list(sentinels))
            names = ", ".join(sentinels[s] for s in ready)
            logger.error("%s exited; stopping the server", names)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.stop()

    def stop(self) -> None:
        """Drain and stop the API servers, then the engine. SIGTERM starts uvicorn's graceful
        shutdown (after a Ctrl-C, which reached them with the process group, it changes nothing)."""
        for p in self.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in self.processes:
            p.join(DRAIN_TIMEOUT)
            if p.is_alive():
                logger.warning("%s did not stop within %.0f s; killing it", p.name, DRAIN_TIMEOUT)
                p.kill()
                p.join(5)
        self.engine.close()
        for sock in set(self.sockets):
            sock.close()
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        shutil.rmtree(self._metrics_dir, ignore_errors=True)


def _api_server_main(index: int, count: int, client, app_kwargs: dict, sock: socket.socket, host: str, port: int,
                     log_level: str, uvicorn_options: dict, ready) -> None:
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s[api {index}]: %(message)s")
    import uvicorn

    from kdaserve.server.app import build_app
    from kdaserve.server.launch import raise_open_file_limit, uvicorn_config

    raise_open_file_limit()
    app = build_app(client, **app_kwargs, api_server=(index, count))
    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if not self.should_exit:
                ready.set()

    server = Server(uvicorn_config(app, host, port, uvicorn_options.pop("log_level", log_level), **uvicorn_options))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
