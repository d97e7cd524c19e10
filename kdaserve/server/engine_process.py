"""The engine in a process of its own (vLLM's engine core), so that the API server's event loop
and the engine's steps no longer share one interpreter lock.

Why: in one process every stream's per-token Python (SSE chunk, JSON, HTTP write) and the engine's
host work (scheduling, step inputs, token appending, detokenizing) take turns on the GIL, so the
engine's step grows with the number of streams (measurements: docs/server.md, docs/perf-notes.md).
Here the engine process steps as it would alone, and the API process formats and writes the
outputs of one step while the engine computes the next.

`EngineProcess` is the API process's handle: it starts the engine process (spawned: CUDA cannot be
forked), waits for its "ready" (or its startup error, raised here as RuntimeError with the
engine's message), and offers what `build_app` reads from an `LLMEngine`: `model_name`, `config`,
`tokenizer` (a copy), `max_model_len`, `vocab_size`, `runner.num_kv_blocks` / `num_slots`, and
`compile_grammar` (the server compiles structured-output grammars for its 400s; the engine process
compiles its own copy off its step loop, since xgrammar's compiled grammars do not pickle).
`server/engine_loop.ProcessEngineLoop` talks to it.

The pipe's protocol, API -> engine: ("add", request id, prompt ids, SamplingParams),
("abort", request id), ("stop",). Engine -> API: ("ready", info) or ("failed", message) once, then
("step", wire outputs (server/output_wire.py), rejections [(request id, message)], stats, tokens the
step computed) per step (or per batch of rejections), ("step_failed", message) when a step raised
(the engine process aborted everything in flight and goes on).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

logger = logging.getLogger("kdaserve.server")
# Worker threads of the engine process that compile structured-output grammars before a request
# reaches the step loop (xgrammar's compiler releases the GIL while it works).
GRAMMAR_THREADS = 2


class EngineProcess:
    """`EngineProcess(engine_kwargs)` starts `LLMEngine(**engine_kwargs)` in a child process and
    returns once it is ready. `setup`: a picklable callable run on the engine in the child before
    it serves (benchmarks replace the device with it). Stop with `close()`."""

    def __init__(self, engine_kwargs: dict, *, setup=None, log_level: str | int = logging.INFO):
        ctx = mp.get_context("spawn")
        commands_r, self._commands = ctx.Pipe(duplex=False)
        self._outputs, outputs_w = ctx.Pipe(duplex=False)
        # daemon: the engine never outlives a server that exits without closing it.
        self.process = ctx.Process(target=_engine_main, name="kdaserve-engine-core", daemon=True,
                                   args=(dict(engine_kwargs), commands_r, outputs_w, setup, log_level))
        self.process.start()
        commands_r.close()
        outputs_w.close()
        self._send_lock = threading.Lock()
        self._grammar_compiler = None
        self._grammar_lock = threading.Lock()
        try:
            message = self._outputs.recv()   # a model load takes as long as it takes
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine process exited during startup (exit code {self.process.exitcode})") from None
        if message[0] != "ready":
            self.process.join(30)
            raise RuntimeError(message[1])
        info = message[1]
        self.model_name, self.config, self.tokenizer = info["model_name"], info["config"], info["tokenizer"]
        self.max_model_len, self.vocab_size, self.stop_ids = info["max_model_len"], info["vocab_size"], info["stop_ids"]
        self.runner = SimpleNamespace(num_kv_blocks=info["num_kv_blocks"], num_slots=info["num_slots"])

    # Called from one thread at a time per direction (the loop's sender thread; its reader thread).
    def send(self, message: tuple) -> None:
        with self._send_lock:
            self._commands.send(message)

    def recv(self) -> tuple:
        return self._outputs.recv()

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    def compile_grammar(self, params):
        """As LLMEngine.compile_grammar, with a compiler of the API process's own."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from kdaserve.engine.structured_output.compiler import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_ids)
        return self._grammar_compiler.compile(params)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine process to stop (it aborts what runs) and wait; kill it past `timeout`."""
        if self.process.is_alive():
            try:
                self.send(("stop",))
            except (OSError, ValueError):
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
                self.process.kill()
                self.process.join(5)
        for conn in (self._commands, self._outputs):
            conn.close()


# ---- the engine process ------------------------------------------------------------------------

def _engine_main(engine_kwargs: dict, commands, outputs, setup, log_level) -> None:
    # Ctrl-C reaches the whole process group: the API process drains and then stops this one
    # (and if the API process dies, the closed pipe ends this one).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    try:
        from kdaserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(**engine_kwargs)
        if setup is not None:
            setup(engine)
        info = {"model_name": engine.model_name, "config": engine.config, "tokenizer": engine.tokenizer,
                "max_model_len": int(engine.max_model_len), "vocab_size": int(engine.vocab_size),
                "stop_ids": sorted(engine.runner.sampler.stop_ids), "num_kv_blocks": engine.runner.num_kv_blocks,
                "num_slots": engine.runner.num_slots}
    except Exception as exc:  # noqa: BLE001 - the API process raises it as the startup error
        if not isinstance(exc, (ValueError, RuntimeError, FileNotFoundError)):   # not a startup check: a bug
            logging.getLogger("kdaserve.engine").exception("the engine failed to start")
        outputs.send(("failed", str(exc) if isinstance(exc, (ValueError, RuntimeError, FileNotFoundError))
                      else f"{type(exc).__name__}: {exc}"))
        return
    outputs.send(("ready", info))
    _EngineCore(engine, commands, outputs).run()


class _EngineCore:
    """The engine process's loop: a receiver thread turns commands into an inbox (compiling
    grammars on the way), the main thread drains it, steps, and sends each step's outputs."""

    def __init__(self, engine, commands, outputs):
        from kdaserve.server.output_wire import OutputEncoder

        self.engine, self._commands, self._outputs = engine, commands, outputs
        self._encoder = OutputEncoder()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()
        self._compiling: set[str] = set()   # adds waiting on a grammar (receiver thread, pool)
        self._cancelled: set[str] = set()   # ... aborted meanwhile: dropped when their grammar is ready
        self._pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="kdaserve-grammar")
        self._receiver = threading.Thread(target=self._receive, name="kdaserve-engine-commands", daemon=True)

    def run(self) -> None:
        self._receiver.start()
        try:
            while not self._stopping:
                self._wake.clear()
                rejections = self._drain()
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._step(rejections)
                else:
                    if rejections:
                        self._send(("step", [], rejections, self.engine.stats(), 0))
                    self._wake.wait()
        finally:
            self._abort_all()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _receive(self) -> None:
        try:
            while True:
                message = self._commands.recv()
                kind = message[0]
                if kind == "stop":
                    break
                if kind == "add" and message[3].structured_outputs is not None:
                    with self._lock:
                        self._compiling.add(message[1])
                    self._pool.submit(self._compile_then_add, message)
                    continue
                if kind == "abort":
                    with self._lock:
                        if message[1] in self._compiling:
                            self._cancelled.add(message[1])
                            continue
                self._put(message)
        except (EOFError, OSError):   # the API process is gone: nobody to serve
            pass
        self._stopping = True
        self._wake.set()

    def _compile_then_add(self, message) -> None:
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
        self._put(message)

    def _put(self, message) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _drain(self) -> list:
        rejections = []
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return rejections
            kind, request_id = message[0], message[1]
            if kind == "add":
                try:
                    self.engine.add_request(request_id, message[2], message[3])
                except ValueError as exc:
                    rejections.append((request_id, str(exc)))
                except Exception as exc:  # noqa: BLE001 - report, keep serving
                    logger.exception("add_request failed")
                    rejections.append((request_id, f"engine failed to add the request: {exc}"))
            elif kind == "reject":
                rejections.append((request_id, message[2]))
            else:
                self.engine.abort_request(request_id)

    def _step(self, rejections: list) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the engine down
            logger.exception("engine step failed; aborting the requests in flight")
            self._abort_all()
            self._send(("step_failed", f"{type(exc).__name__}: {exc}"))
            self._send(("step", [], rejections, self.engine.stats(), 0))   # the pools are empty now
            return
        encode = self._encoder.encode
        tokens, self.engine.last_step_tokens = self.engine.last_step_tokens, 0
        self._send(("step", [encode(out) for out in outputs], rejections, self.engine.stats(), tokens))

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        while self.engine.has_unfinished_requests():   # the abort outputs; nobody needs them now
            try:
                for out in self.engine.step():
                    self._encoder.encode(out)
            except Exception:  # noqa: BLE001
                break

    def _send(self, message) -> None:
        try:
            self._outputs.send(message)
        except (OSError, ValueError, BrokenPipeError):
            self._stopping = True
