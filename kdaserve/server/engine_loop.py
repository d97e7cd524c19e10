"""The engine's own thread, and the asyncio side that HTTP handlers talk to.

`LLMEngine` is single-threaded, so one dedicated thread owns every call to `add_request`,
`abort_request` and `step`. Handlers never touch the engine: they post commands to a thread-safe
inbox and wake the thread; the thread delivers each request's outputs to that request's asyncio
queue with `loop.call_soon_threadsafe`. With nothing to do the thread sleeps on an event, so an idle
server burns no CPU. torch releases the GIL inside its kernels, so HTTP keeps flowing while the
engine computes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kdaserve.server.errors import APIError
from kdaserve.server.metrics import ServerMetrics, observe_many

logger = logging.getLogger("kdaserve.server")
# Outputs waiting for one HTTP request's handler: past this its client is not keeping up (a stream
# nobody reads blocks the handler in `send`), and the request is aborted, its slots freed.
MAX_PENDING_OUTPUTS = 4096


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    score_only: bool = False   # echo with max_tokens 0: the one token the engine samples is hidden
    admitted: bool = False     # its prompt tokens are counted (an engine in its own process: at its first output)


class RequestGroup:
    """The engine requests behind one HTTP request (prompts x `n`), seen from the event loop.

    Iterating yields `(index, RequestOutput)` in the order the engine produced them, until every
    member finished, only outputs with progress (new tokens, or the end); an error for a member
    (bad input -> APIError 400) is raised from the iteration.
    Use it as an async context manager: leaving the block while members still run (client
    disconnect, an error, cancellation) aborts them in the engine, freeing their slots.
    """

    def __init__(self, engine_loop: EngineLoop, request_ids: list[str], loop: asyncio.AbstractEventLoop,
                 max_pending: int = MAX_PENDING_OUTPUTS):
        self.request_ids = request_ids
        self._unfinished = set(range(len(request_ids)))
        self._engine_loop = engine_loop
        self._loop = loop
        # Holders [index, item, outputs merged into it] in arrival order, and the future the one
        # reader (the handler) awaits while there are none: asyncio.Queue's generality costs
        # three times as much per output, paid per token of every stream.
        self._ready: collections.deque = collections.deque()
        self._reader: asyncio.Future | None = None
        self._waiting: dict[int, list] = {}             # index -> its output's holder still in the queue
        self._pending = 0                               # outputs delivered and not yet taken
        self._closed = False
        self._max_pending = max_pending
        self.overflowed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    # Called from the engine thread.
    def deliver(self, index: int, item: Any) -> None:
        _call_in_loop(self._loop, self._put, index, item)

    # Called on the event loop.
    def _put(self, index: int, item: Any) -> None:
        if self.overflowed:
            return
        if not isinstance(item, BaseException) and not item.new_token_ids and not item.finished:
            return   # no progress (a prompt chunk's log-probs): the next output holds everything so far
        if self._pending >= self._max_pending:
            # The handler stopped taking outputs (its client stopped reading): abort now rather
            # than let the request run on for nobody; the handler sees the error when it resumes.
            self.overflowed = True
            logger.warning("request %s: %d outputs not taken by its client; aborted", self.request_ids[0], self._max_pending)
            unfinished = sorted(self._unfinished)
            self.close()
            self._unfinished = set(unfinished[:1])
            self._push([unfinished[0] if unfinished else 0, APIError(
                503, f"the client did not read its stream: {self._max_pending} outputs were waiting", code="client_too_slow"), 0])
            return
        self._pending += 1
        holder = self._waiting.get(index)
        if holder is not None and not isinstance(item, BaseException):
            # The handler has not taken this member's last output yet (it is writing other
            # streams): one output for both, as vLLM's output collector does. An output holds
            # everything so far; only its new tokens are a delta. One SSE chunk then carries
            # both steps' tokens, so a server that falls behind writes fewer, larger chunks.
            item.new_token_ids = holder[1].new_token_ids + item.new_token_ids
            holder[1] = item
            holder[2] += 1
            return
        holder = [index, item, 1]
        if not isinstance(item, BaseException):
            self._waiting[index] = holder
        self._push(holder)

    def _push(self, holder: list) -> None:
        self._ready.append(holder)
        reader = self._reader
        if reader is not None:
            self._reader = None
            if not reader.done():   # (cancelled: its handler is gone)
                reader.set_result(None)

    def replay(self, taken: list[tuple[int, Any]]) -> None:
        """Put outputs taken from the group back in front, in order (serving.run_group waits for
        every member's first output before it answers, then streams from the first)."""
        for index, out in reversed(taken):
            self._ready.appendleft([index, out, 0])

    async def next(self) -> tuple[int, Any]:
        if not self._unfinished and not self._ready:
            raise StopAsyncIteration
        while not self._ready:
            self._reader = self._loop.create_future()
            await self._reader
        holder = self._ready.popleft()
        index, item, merged = holder
        self._pending -= merged
        if self._waiting.get(index) is holder:
            del self._waiting[index]
        if isinstance(item, BaseException):
            self._unfinished.discard(index)  # the engine thread already dropped it
            raise item
        if item.finished:
            self._unfinished.discard(index)
        return index, item

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.next()

    def close(self) -> None:
        """Abort the members still running; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine_loop._release(len(self.request_ids))
        for index in sorted(self._unfinished):
            self._engine_loop._post(("abort", self.request_ids[index]))
        self._unfinished.clear()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
        pass


def _deliver_all(deliveries: list) -> None:
    for group, index, out in deliveries:
        group._put(index, out)


def _send_all(deliveries: list) -> None:
    """A step's deliveries (all to one event loop): one wake-up of it per step, not one per request."""
    if deliveries:
        _call_in_loop(deliveries[0][0]._loop, _deliver_all, deliveries)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: Any
    group: RequestGroup
    index: int
    score_only: bool = False
    images: tuple = ()   # the prompt's images, placed (engine/multimodal.ImageItem)
    arrival: float = field(default_factory=time.monotonic)


class EngineLoop:
    """Runs an `LLMEngine` in its own thread and admits requests up to a queue limit."""

    def __init__(self, engine, *, max_queued_requests: int = 1024, metrics: ServerMetrics | None = None,
                 api_server_count: int = 1):
        self.engine = engine
        # Requests in flight beyond the engine's batch: past this, new ones get 503. Several API
        # server processes share the limit evenly.
        # Rounded down (at least 1 each), so that together they admit no more than one process would.
        self.max_in_flight = max((engine.info.max_num_seqs + max_queued_requests) // api_server_count, 1)
        self._limit_source = "--max-num-seqs + --max-queued-requests" + (
            f", shared by {api_server_count} API server processes" if api_server_count > 1 else "")
        self.metrics = metrics
        self.num_in_flight = 0  # touched only on the event loop
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._members: dict[str, tuple[RequestGroup, int]] = {}  # engine thread only
        self._timings: dict[str, _Timing] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="kdaserve-engine", daemon=True)
        self.last_error: str | None = None
        # Called (from the engine's thread) with the error when the engine stops on its own, not on
        # shutdown: `kdaserve serve` then exits non-zero, as vLLM's server does, so that a
        # supervisor restarts it instead of a server answering 503 forever.
        self.on_engine_exit = None

    def _engine_exited(self) -> None:
        if self.on_engine_exit is not None:
            try:
                self.on_engine_exit(self.last_error)
            except Exception:   # the callback must not hide the engine's own error
                logger.exception("on_engine_exit failed")

    # ---- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def check_request_size(self, sequences: int) -> None:
        """A 400 with the numbers when one request holds more sequences (prompts x n) than the
        server admits at once: no retry can help."""
        if sequences > self.max_in_flight:
            raise APIError(400, f"this request holds {sequences} sequences (prompts x n) but the server admits at most "
                                f"{self.max_in_flight} at once ({self._limit_source})", param="n",
                           code="request_too_large")

    def open_group(self, requests: list[tuple]) -> RequestGroup:
        """Submit `(request_id, prompt_token_ids, params[, score_only[, images]])`s together, or raise 503
        when the queue is full (all or none: a request with several prompts is never half
        admitted). A score-only request's hidden token is not counted as generated."""
        if not self.is_alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        self.check_request_size(len(requests))
        if self.num_in_flight + len(requests) > self.max_in_flight:
            raise APIError(
                503,
                f"server is busy: {self.num_in_flight} requests in flight, limit {self.max_in_flight}; retry later",
                code="queue_full",
            )
        self.num_in_flight += len(requests)
        group = RequestGroup(self, [r[0] for r in requests], asyncio.get_running_loop())
        for index, (request_id, prompt_token_ids, params, *rest) in enumerate(requests):
            self._post(_Add(request_id, list(prompt_token_ids), params, group, index, score_only=bool(rest and rest[0]),
                            images=tuple(rest[1]) if len(rest) > 1 else ()))
        return group

    def _release(self, count: int) -> None:
        self.num_in_flight -= count

    def _post(self, command) -> None:
        self._inbox.put(command)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        reason = APIError(503, "the server is shutting down", code="shutting_down")
        try:
            while not self._stopping:
                # Clear before draining: a command posted after the drain sets the event again,
                # so the wait below returns at once instead of missing it.
                self._wake.clear()
                self._drain_inbox()
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wake.wait()
        except BaseException as exc:
            logger.exception("the engine thread died; /health now answers 503")
            self.last_error = f"{type(exc).__name__}: {exc}"
            reason = APIError(503, f"the engine stopped: {self.last_error}", code="engine_unavailable")
            self._engine_exited()
            raise
        finally:
            self._stopping = True
            self._fail_all(reason)
            # Requests posted while the thread was ending must not wait forever either.
            while True:
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Add):
                    command.group.deliver(command.index, reason)

    def _drain_inbox(self) -> None:
        changed = False
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            changed = True
            if isinstance(command, _Add):
                self._add(command)
            else:
                self._abort(command[1])
        if changed:
            self._refresh_gauges()

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    images=list(command.images) or None)
        except ValueError as exc:
            command.group.deliver(command.index, APIError(400, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            logger.exception("add_request failed")
            command.group.deliver(command.index, APIError(500, f"engine failed to add the request: {exc}"))
            return
        self._members[command.request_id] = (command.group, command.index)
        self._timings[command.request_id] = _Timing(command.arrival, score_only=command.score_only)
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(command.prompt_token_ids))

    def _abort(self, request_id: str) -> None:
        if self._members.pop(request_id, None) is None:
            return  # finished meanwhile
        self._timings.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001
            logger.exception("abort_request(%s) failed", request_id)
        if self.metrics:
            self.metrics.finished("abort").inc()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the server down
            logger.exception("engine step failed; failing the requests in flight")
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._fail_all(APIError(500, f"engine step failed: {self.last_error}", code="engine_error"))
            return
        deliveries = []
        self._route(outputs, deliveries)
        _send_all(deliveries)
        self._refresh_gauges()

    def _route(self, outputs, deliveries: list) -> None:
        """Each output of a member to its group (appended to `deliveries`), observed in the
        metrics; a finished member leaves."""
        now = time.monotonic()
        generated = 0
        intervals: list[float] = []
        for out in outputs:
            member = self._members.get(out.request_id)
            if member is None:
                continue  # aborted while the step ran
            generated += self._observe(out, now, intervals)
            if out.finished:
                del self._members[out.request_id]
            deliveries.append((*member, out))
        # Once per step, not per output (a metric update is a lock, or a file write).
        if generated:
            self.metrics.generation_tokens.inc(generated)
        if intervals:
            observe_many(self.metrics.inter_token_latency, intervals)

    def _observe(self, out, now: float, intervals: list[float]) -> int:
        """An output in the metrics (latencies; a finished request's figures); returns its new
        tokens for the step's count of generated tokens, and adds its inter-token intervals to
        `intervals` (observed together, once per step)."""
        timing = self._timings.get(out.request_id)
        if self.metrics is None or timing is None:
            return 0
        new_tokens = 0 if timing.score_only else len(out.new_token_ids or ())
        if new_tokens:
            if timing.first_token is None:
                timing.first_token = now
                self.metrics.time_to_first_token.observe(now - timing.arrival)
            else:   # one interval per token (several when a step yields several)
                intervals.extend([(now - timing.last_token) / new_tokens] * new_tokens)
            timing.last_token = now
        if out.finished:
            self._timings.pop(out.request_id, None)
            self.metrics.finished(out.finish_reason or "stop").inc()
            # The server's arrival (before any queueing here) with the engine's own timestamps.
            self.metrics.observe_finished({**(out.metrics or {}), "arrival_time": timing.arrival, "finish_time": now},
                                          out.num_prompt_tokens, 0 if timing.score_only else len(out.output_token_ids))
        return new_tokens

    def _fail_all(self, error: APIError) -> None:
        for request_id, (group, index) in list(self._members.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                pass
            group.deliver(index, error)
        self._members.clear()
        self._timings.clear()
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        if self.metrics is None:
            return
        tokens, self.engine.last_step_tokens = self.engine.last_step_tokens, 0
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - metrics must never break serving
            logger.debug("engine.stats() failed", exc_info=True)
            return
        self._gauges_from(stats, tokens)

    def _gauges_from(self, stats: dict, step_tokens: int) -> None:
        if self.metrics is None:
            return
        if step_tokens:
            self.metrics.iteration_tokens.observe(step_tokens)
        try:
            self.metrics.update_from_stats(stats)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            logger.debug("update_from_stats failed", exc_info=True)


class ProcessEngineLoop(EngineLoop):
    """The same API for an engine in its own process (engine/engine_process.py): commands go to
    it through a sender thread (a large prompt never blocks the event loop on a full pipe), and a
    reader thread takes each step's outputs, rebuilds them (engine/output_wire.py), keeps the
    metrics and hands them to the event loop in one wake-up per step, as the engine thread does
    in-process. The members and timings are shared by the event loop (add, abort) and the reader
    (outputs), under one lock."""

    def __init__(self, engine, *, max_queued_requests: int = 1024, metrics: ServerMetrics | None = None,
                 api_server_count: int = 1):
        from kdaserve.engine.output_wire import OutputDecoder

        super().__init__(engine, max_queued_requests=max_queued_requests, metrics=metrics,
                         api_server_count=api_server_count)
        self._decoder = OutputDecoder(engine.info.tokenizer)   # for the text the engine process leaves to us
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, name="kdaserve-engine-outputs", daemon=True)
        self._sender = threading.Thread(target=self._send_commands, name="kdaserve-engine-commands", daemon=True)

    def start(self) -> None:
        self._sender.start()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._outbox.put(None)
        self._sender.join(timeout)
        self.engine.close(timeout=max(timeout, 1.0))   # the reader sees the pipe close and ends
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.engine.is_alive

    # ---- event-loop side -------------------------------------------------------------------
    def _post(self, command) -> None:
        if isinstance(command, _Add):
            with self._lock:
                if self._stopping:   # the reader failed everything just now: nobody would answer this one
                    command.group.deliver(command.index, APIError(
                        503, f"the engine stopped: {self.last_error or 'the server is shutting down'}",
                        code="engine_unavailable"))
                    return
                self._members[command.request_id] = (command.group, command.index)
                self._timings[command.request_id] = _Timing(command.arrival, score_only=command.score_only)
                self._decoder.begin(command.request_id, command.prompt_token_ids)
            self._outbox.put(("add", command.request_id, command.prompt_token_ids, command.params, command.images))
            return
        request_id = command[1]
        with self._lock:
            known = self._members.pop(request_id, None) is not None
            self._timings.pop(request_id, None)
            self._decoder.forget(request_id)
        if known:
            self._outbox.put(("abort", request_id))
            if self.metrics:
                self.metrics.finished("abort").inc()

    def _send_commands(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.engine.send(message)
            except (OSError, ValueError):   # the engine process is gone; the reader reports it
                return

    # ---- reader thread ---------------------------------------------------------------------
    def _read(self) -> None:
        reason = APIError(503, "the server is shutting down", code="shutting_down")
        try:
            while True:
                message = self.engine.recv()
                if message[0] == "step":
                    self._take_step(*message[1:])
                elif message[0] == "detached":   # this API process left the engine (EngineClient.close)
                    return
                elif message[0] == "step_failed":
                    logger.error("engine step failed; failing the requests in flight: %s", message[1])
                    self.last_error = message[1]
                    self._fail_all(APIError(500, f"engine step failed: {message[1]}", code="engine_error"))
        except (EOFError, OSError):
            if not self._stopping:
                code = self.engine.exitcode
                self.last_error = "the engine process exited" + (f" (exit code {code})" if code is not None else "")
                logger.error("%s; /health now answers 503", self.last_error)
                reason = APIError(503, f"the engine stopped: {self.last_error}", code="engine_unavailable")
                self._engine_exited()
        finally:
            with self._lock:   # no member registers after this (see _post)
                self._stopping = True
            self._fail_all(reason)

    def _take_step(self, wires: list, rejections: list, stats: dict, step_tokens: int) -> None:
        deliveries = []
        with self._lock:
            for request_id, message in rejections:
                member = self._members.pop(request_id, None)
                self._timings.pop(request_id, None)
                self._decoder.forget(request_id)
                if member is not None:
                    deliveries.append((*member, APIError(400, message)))
            # The decoder knows exactly the members (begun and forgotten with them): None for the rest.
            self._route((out for out in map(self._decoder.decode, wires) if out is not None), deliveries)
        _send_all(deliveries)
        self._gauges_from(stats, step_tokens)

    def _observe(self, out, now: float, intervals: list[float]) -> int:
        timing = self._timings.get(out.request_id)
        if self.metrics is not None and timing is not None and not timing.admitted:
            timing.admitted = True   # counted once the engine took it (a rejected prompt is not)
            self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        return super()._observe(out, now, intervals)

    def _fail_all(self, error: APIError) -> None:
        with self._lock:
            members = list(self._members.values())
            for request_id in list(self._members):
                self._decoder.forget(request_id)
                self._outbox.put(("abort", request_id))
            self._members.clear()
            self._timings.clear()
        for group, index in members:
            group.deliver(index, error)
