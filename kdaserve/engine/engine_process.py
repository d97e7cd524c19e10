"""The engine in a process of its own (vLLM's engine core), so that the API server's event loop
and the engine's steps no longer share one interpreter lock.

Why: in one process every stream's per-token Python (SSE chunk, JSON, HTTP write) and the engine's
host work (scheduling, step inputs, token appending, detokenizing) take turns on the GIL, so the
engine's step grows with the number of streams (measurements: docs/server.md, docs/perf-notes.md).
Here the engine process steps as it would alone, and the API process formats and writes the
outputs of one step while the engine computes the next.

`EngineProcess` is the API process's handle: it starts the engine process (spawned: CUDA cannot be forked),
waits for its "ready" (or its startup error, raised here as RuntimeError with the engine's message), and
offers what `build_app` reads from an `LLMEngine`: `info` (engine/info.py, the engine's EngineInfo, its
tokenizer a copy) and `compile_grammar` (the server compiles structured-output grammars for its 400s; the
engine process compiles its own copy off its step loop, since xgrammar's compiled grammars do not pickle).
`server/engine_loop.ProcessEngineLoop` talks to it. With `--api-server-count N` the engine process serves N
connections, one per API server process (`EngineClient`, picklable), each receiving the outputs of the
requests it added (server/api_servers.py).

A connection's protocol, API -> engine: ("add", request id, prompt ids, SamplingParams, images),
("abort", request id), ("detach",). Engine -> API: ("ready", info) or ("failed", message) once on
the first connection, then ("step", wire outputs (engine/output_wire.py), rejections [(request id,
message)], stats, tokens the step computed) per step (or per batch of rejections), ("step_failed",
message) when a step raised (the engine process aborted everything in flight and goes on),
("detached",) after a "detach". The owner stops the engine through a control pipe: ("stop",).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

from kdaserve.engine.info import EngineInfo

logger = logging.getLogger("kdaserve.server")
# Worker threads of the engine process that compile structured-output grammars before a request
# reaches the step loop (xgrammar's compiler releases the GIL while it works).
GRAMMAR_THREADS = 2


class EngineClient:
    """One API process's connection to the engine process: its command and output pipes, and what
    `build_app` reads of the engine. Picklable (the pipes travel to a spawned API server process:
    `--api-server-count`); the engine process routes each request's outputs to the connection that
    added it."""

    exitcode = None   # the engine process's, where this handle can see it (EngineProcess)

    def __init__(self, info: EngineInfo, commands, outputs):
        self.info, self._commands, self._outputs = info, commands, outputs
        self._init_locks()

    def _init_locks(self) -> None:
        self._send_lock = threading.Lock()
        self._grammar_compiler = None
        self._grammar_lock = threading.Lock()
        self._closed = False

    def __getstate__(self):
        return {"info": self.info, "commands": self._commands, "outputs": self._outputs}

    def __setstate__(self, state):
        self.__init__(state["info"], state["commands"], state["outputs"])

    # Called from one thread at a time per direction (the loop's sender thread; its reader thread).
    def send(self, message: tuple) -> None:
        with self._send_lock:
            self._commands.send(message)

    def recv(self) -> tuple:
        return self._outputs.recv()

    @property
    def is_alive(self) -> bool:
        return not self._closed

    def compile_grammar(self, params):
        """As LLMEngine.compile_grammar, with a compiler of the API process's own."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from kdaserve.engine.structured_output.compiler import GrammarCompiler

                info = self.info
                self._grammar_compiler = GrammarCompiler(info.tokenizer, info.vocab_size, list(info.stop_ids),
                                                         max_whitespace=info.config.structured_outputs_max_whitespace)
        return self._grammar_compiler.compile(params)

    def close(self, timeout: float = 30.0) -> None:
        """Leave the engine (it aborts this connection's requests and answers "detached", which
        ends the reader's recv) and close the pipes; the engine process serves on."""
        if self._closed:
            return
        self._closed = True
        try:
            self.send(("detach",))
        except (OSError, ValueError):
            pass
        self._commands.close()   # the output pipe: the reader closes it when it has read "detached"


class EngineProcess(EngineClient):
    """`EngineProcess(engine_kwargs)` starts `LLMEngine(**engine_kwargs)` in a child process and
    returns once it is ready; it is then the API side of the first connection. `api_clients`:
    connections in all (one per API server process, `clients()`). `setup`: a picklable callable run
    on the engine in the child before it serves (benchmarks replace the device with it). Stop with
    `close()`, which stops the engine process."""

    def __init__(self, engine_kwargs: dict, *, setup=None, log_level: str | int = logging.INFO, api_clients: int = 1):
        if api_clients < 1:
            raise ValueError(f"api_clients must be at least 1, got {api_clients}")
        ctx = mp.get_context("spawn")
        pipes = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(api_clients)]
        control_r, self._control = ctx.Pipe(duplex=False)
        engine_ends = [(commands_r, outputs_w) for (commands_r, _), (_, outputs_w) in pipes]
        # daemon: the engine never outlives a server that exits without closing it. With tensor
        # parallelism it starts the other ranks, which a daemon process may not: it then ends when
        # its pipes close (the server gone) and stops its ranks as it goes.
        tp = int(engine_kwargs.get("tensor_parallel_size") or 1)
        self.process = ctx.Process(target=_engine_main, name="kdaserve-engine-core", daemon=tp == 1,
                                   args=(dict(engine_kwargs), engine_ends, control_r, setup, log_level))
        self.process.start()
        for end in (control_r, *(c for pair in engine_ends for c in pair)):
            end.close()
        api_ends = [(commands_w, outputs_r) for (_, commands_w), (outputs_r, _) in pipes]
        try:
            message = api_ends[0][1].recv()   # a model load takes as long as it takes
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine process exited during startup (exit code {self.process.exitcode})") from None
        if message[0] != "ready":
            self.process.join(30)
            raise RuntimeError(message[1])
        super().__init__(message[1], *api_ends[0])
        self._ends = api_ends

    def clients(self) -> list[EngineClient]:
        """A handle per connection, to hand to the API server processes (this handle's own
        connection is the first: use either, not both)."""
        return [EngineClient(self.info, *ends) for ends in self._ends]

    @property
    def exitcode(self):
        # Its pipes close as it dies, a moment before it can be reaped: wait that moment.
        self.process.join(1.0)
        return self.process.exitcode

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine process to stop (it aborts what runs) and wait; kill it past `timeout`."""
        if self.process.is_alive():
            try:
                self._control.send(("stop",))
            except (OSError, ValueError):
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
                self.process.kill()
                self.process.join(5)
        for conn in (self._control, *(c for ends in self._ends for c in ends)):
            conn.close()


# ---- the engine process ------------------------------------------------------------------------

def _engine_main(engine_kwargs: dict, connections: list, control, setup, log_level) -> None:
    # Ctrl-C reaches the whole process group: the API process drains and then stops this one
    # (and if the API processes die, the closed pipes end this one).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    first_outputs = connections[0][1]
    try:
        from kdaserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(**engine_kwargs)
        if setup is not None:
            setup(engine)
        info = engine.info
    except Exception as exc:  # noqa: BLE001 - the API process raises it as the startup error
        if not isinstance(exc, (ValueError, RuntimeError, FileNotFoundError)):   # not a startup check: a bug
            logging.getLogger("kdaserve.engine").exception("the engine failed to start")
        first_outputs.send(("failed", str(exc) if isinstance(exc, (ValueError, RuntimeError, FileNotFoundError))
                            else f"{type(exc).__name__}: {exc}"))
        return
    first_outputs.send(("ready", info))
    _EngineCore(engine, connections, control).run()


class _EngineCore:
    """The engine process's loop: a receiver thread per connection turns its commands into one
    inbox (compiling grammars on the way), the main thread drains it, steps, and sends each
    connection the outputs of its own requests (with the engine's stats: every connection every
    step; the step's token count to the first only, which keeps the engine-wide metrics).

    A connection's commands: ("add", request id, prompt ids, SamplingParams, images), ("abort", request
    id), ("detach",) (its API process leaves: its requests are aborted, "detached" answers). The
    control pipe (the process's owner): ("stop",). Request ids are unique across connections
    (the API processes make them from uuid4); a connection aborts only its own."""

    def __init__(self, engine, connections: list, control):
        from kdaserve.engine.output_wire import OutputEncoder

        self.engine, self._control = engine, control
        # Text only where a stop string needs it: the API processes detokenize the rest (output_wire.py).
        engine.output.detokenize = False
        self._commands = [c for c, _ in connections]
        self._outputs = [o for _, o in connections]
        self._live = [True] * len(connections)   # main thread only
        self._owner: dict[str, int] = {}           # request id -> connection; main thread only
        self._encoder = OutputEncoder()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()
        self._compiling: set[str] = set()   # adds waiting on a grammar (receiver threads, pool)
        self._cancelled: set[str] = set()   # ... aborted meanwhile: dropped when their grammar is ready
        self._pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="kdaserve-grammar")
        self._receivers = [threading.Thread(target=self._receive, args=(i,), name=f"kdaserve-engine-commands-{i}",
                                            daemon=True) for i in range(len(connections))]
        self._receivers.append(threading.Thread(target=self._receive_control, name="kdaserve-engine-control",
                                                daemon=True))

    def run(self) -> None:
        for thread in self._receivers:
            thread.start()
        try:
            while not self._stopping:
                self._wake.clear()
                rejections = self._drain()
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._step(rejections)
                else:
                    stats = self.engine.stats() if rejections else None
                    for client, rejected in rejections.items():
                        self._send(client, ("step", [], rejected, stats, 0))
                    self._wake.wait()
        finally:
            self._abort_all()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.engine.close()   # the other tensor-parallel ranks, if any

    def _receive(self, client: int) -> None:
        try:
            while True:
                message = self._commands[client].recv()
                kind = message[0]
                if kind == "detach":
                    break
                if kind == "add" and message[3].structured_outputs is not None:
                    with self._lock:
                        self._compiling.add(message[1])
                    self._pool.submit(self._compile_then_add, client, message)
                    continue
                if kind == "abort":
                    with self._lock:
                        if message[1] in self._compiling:
                            self._cancelled.add(message[1])
                            continue
                self._put(client, message)
        except (EOFError, OSError):   # the API process is gone
            pass
        self._put(client, ("gone", None))

    def _receive_control(self) -> None:
        try:
            self._control.recv()   # ("stop",)
        except (EOFError, OSError):   # the owner is gone: nobody to serve
            pass
        self._stopping = True
        self._wake.set()

    def _compile_then_add(self, client: int, message) -> None:
        request_id = message[1]
        try:
            self.engine.compile_grammar(message[3].structured_outputs)
        except ValueError as exc:
            message = ("reject", request_id, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the request, the engine goes on
            message = ("reject", request_id, f"cannot compile the request's grammar: {exc}")
        with self._lock:
            self._compiling.discard(request_id)
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                return
        self._put(client, message)

    def _put(self, client: int, message) -> None:
        self._inbox.put((client, message))
        self._wake.set()

    def _drain(self) -> dict[int, list]:
        """Apply the commands received; the rejections to send, by connection."""
        rejections: dict[int, list] = {}
        while True:
            try:
                client, message = self._inbox.get_nowait()
            except queue.Empty:
                return rejections
            kind, request_id = message[0], message[1]
            if kind == "add":
                if not self._live[client]:
                    continue
                try:
                    self.engine.add_request(request_id, message[2], message[3],
                                            images=list(message[4]) if len(message) > 4 and message[4] else None)
                    self._owner[request_id] = client
                except ValueError as exc:
                    rejections.setdefault(client, []).append((request_id, str(exc)))
                except Exception as exc:  # noqa: BLE001 - report, keep serving
                    logger.exception("add_request failed")
                    rejections.setdefault(client, []).append((request_id, f"engine failed to add the request: {exc}"))
            elif kind == "reject":
                rejections.setdefault(client, []).append((request_id, message[2]))
            elif kind == "gone":
                self._detach(client)
            elif self._owner.get(request_id) == client:
                del self._owner[request_id]
                self.engine.abort_request(request_id)

    def _detach(self, client: int) -> None:
        """A connection whose API process left (or died): abort its requests; the others go on."""
        if not self._live[client]:
            return
        self._live[client] = False
        for request_id in [r for r, c in self._owner.items() if c == client]:
            del self._owner[request_id]
            self.engine.abort_request(request_id)
        try:
            self._outputs[client].send(("detached",))
        except (OSError, ValueError):
            pass
        if not any(self._live):   # every API process is gone: nobody to serve
            self._stopping = True

    def _step(self, rejections: dict[int, list]) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the engine down
            logger.exception("engine step failed; aborting the requests in flight")
            self._abort_all()
            stats = self.engine.stats()   # the pools are empty now
            for client in range(len(self._outputs)):
                self._send(client, ("step_failed", f"{type(exc).__name__}: {exc}"))
                self._send(client, ("step", [], rejections.get(client, []), stats, 0))
            return
        by_client: list[list] = [[] for _ in self._outputs]
        for out in outputs:
            client = self._owner.get(out.request_id)
            wire = self._encoder.encode(out)   # always: the encoder forgets finished requests
            if client is not None:   # None: aborted (its API process forgot it)
                by_client[client].append(wire)
                if out.finished:
                    del self._owner[out.request_id]
        tokens, self.engine.last_step_tokens = self.engine.last_step_tokens, 0
        stats = self.engine.stats()
        for client, wires in enumerate(by_client):
            self._send(client, ("step", wires, rejections.get(client, []), stats, tokens if client == 0 else 0))

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        self._owner.clear()
        while self.engine.has_unfinished_requests():   # the abort outputs; nobody needs them now
            try:
                for out in self.engine.step():
                    self._encoder.encode(out)
            except Exception:  # noqa: BLE001
                break

    def _send(self, client: int, message) -> None:
        if not self._live[client]:
            return
        try:
            self._outputs[client].send(message)
        except (OSError, ValueError, BrokenPipeError):
            self._detach(client)
