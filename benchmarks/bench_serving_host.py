"""The serving path's host cost: inter-token latency through `kdaserve serve`'s app against the
engine's own step, with the model replaced by a fixed "device time" (runs on a CPU) or the real one.

Why: issue 21 asks for the server's median ITL within 1.15x of the engine's own step. With the
engine in a thread of the server's process, the event loop (SSE chunks, JSON, HTTP writes) and the
engine's host work share one interpreter lock; `kdaserve serve` therefore runs the engine in its
own process (engine/engine_process.py), and `--no-engine-process` measures the thread. Results:
docs/perf-notes.md.

How: the real engine (scheduler, host step building, token appending, detokenizing, outputs) and
the real app (uvicorn, FastAPI), the `nano` model's tokenizer; only `ModelRunner.execute` is
replaced: it builds the host step as the real one does and returns the next token of a fixed text
for every sampling sequence, readable `--device-ms` after the fake device (one step at a time)
took the step up: reading them sooner sleeps (the GIL released, like a host waiting for a GPU), so
async scheduling overlaps the host's work with that time as with a GPU's. A client
in another process opens `--streams` streaming completions at once and stamps every SSE chunk.
A first round of short streams is not reported (every server process past its first requests).
Reported: the engine's step period in steady decode (in a thread: the interval between execute
calls of steps without prefills; in its own process: between the arrivals of steps' outputs), the
clients' median / p90 ITL (interval between a stream's chunks), and ITL / the same engine's step
alone (no server, measured first in a process of its own); and the CPU time per SSE chunk of the
event loop's thread and of the whole server process (with the engine in a thread, its host work
is in the latter). The goal of issue 21 is ITL <= 1.15x the step (on the GPU machine's host;
this prints what this host does).

    PYTHONPATH=$PWD python benchmarks/bench_serving_host.py [--streams 64] [--device-ms 2.5]
        [--max-tokens 128] [--rounds 3] [--profile FILE] [--model bench] [--no-engine-process]
        [--api-server-count N]

`--profile FILE`: a cProfile (pstats file) of the event loop's thread over the last round.
`--model NAME`: the real model on this machine's device instead (a GPU: CUDA graphs, the engine's
default backends), the steps stamped the same way; `--device-ms` is then unused.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = b"def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


def client(url: str, model: str, streams: int, max_tokens: int, out: mp.Queue, kind: str = "raw",
           cpus: set[int] | None = None, first: int = 0, start=None) -> None:
    """`kind` "raw": a lean asyncio HTTP/1.1 client (so that the client's own Python is not what
    bunches the chunks); "httpx": httpx's streaming client; "openai": the OpenAI Python SDK's
    async streaming completions, as an application would call the server (a real client)."""
    if cpus:
        pin(os.getpid(), cpus)

    def body(i: int) -> dict:
        return {"model": model, "prompt": f"# stream {first + i}\n", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}

    async def one_httpx(http, i: int) -> list[float]:
        stamps = []
        async with http.stream("POST", f"{url}/v1/completions", json=body(i)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    stamps.append(time.monotonic())
        return stamps

    async def one_openai(api, i: int) -> list[float]:
        stamps = []
        b = body(i)
        stream = await api.completions.create(model=b.pop("model"), prompt=b.pop("prompt"), max_tokens=b.pop("max_tokens"),
                                              temperature=b.pop("temperature"), stream=True,
                                              extra_body={"ignore_eos": b.pop("ignore_eos")})
        async for chunk in stream:
            if chunk.choices:
                stamps.append(time.monotonic())
        return stamps

    async def one_raw(i: int) -> list[float]:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        payload = json.dumps(body(i)).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload))
        stamps, buf = [], b""
        await reader.readuntil(b"\r\n\r\n")
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            now = time.monotonic()
            *events, buf = (buf + data).split(b"\n\n")   # SSE events; chunked framing bytes ride along
            done = any(b"data: [DONE]" in e for e in events)
            stamps += [now] * sum(1 for e in events if b"data: {" in e)
            if done:
                break
        writer.close()
        return stamps

    def ready() -> None:   # every client process set up (imports, HTTP client) before any stream opens
        if start is not None:
            start.wait()

    async def main() -> list[list[float]]:
        if kind == "raw":
            ready()
            return await asyncio.gather(*(one_raw(i) for i in range(streams)))
        if kind == "openai":
            import openai

            # The SDK's own HTTP client (its default pool takes far more than 64 connections).
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0) as api:
                ready()
                return await asyncio.gather(*(one_openai(api, i) for i in range(streams)))
        import httpx

        limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            ready()
            return await asyncio.gather(*(one_httpx(http, i) for i in range(streams)))

    out.put(asyncio.run(main()))


class _FakePendingSample:
    """A fixed-time device's sampled tokens: ready `device_s` after the device took the step up
    (it runs one step at a time), as a GPU's PendingSample; reading them waits until then."""

    def __init__(self, tokens: list[int], ready_at: float):
        import torch

        self.tokens = torch.tensor(tokens, dtype=torch.int64)   # what an overlapped next step reads
        self._ids, self._ready_at = tokens, ready_at

    @property
    def token_ids(self) -> list[int]:
        wait = self._ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)   # the GIL released, like a host waiting for a GPU
            if _active_trace is not None:
                _active_trace.wait += wait
        return self._ids

    @property
    def logprobs(self) -> list:
        return [None] * len(self._ids)


def run_client(url: str, model: str, streams: int, max_tokens: int, kind: str,
               cpus: set[int] | None = None, processes: int = 1) -> list[list[float]]:
    """The client in processes of its own (its Python must not share the server's interpreter),
    the streams split evenly over `processes` of them (a client whose per-chunk Python cannot
    keep up stamps chunks late and in bunches): each stream's chunk arrival times."""
    ctx = mp.get_context("spawn")
    n = max(1, min(processes, streams))
    shares = [streams // n + (j < streams % n) for j in range(n)]
    queues = [ctx.Queue() for _ in shares]
    start = ctx.Barrier(n)
    procs = [ctx.Process(target=client, args=(url, model, share, max_tokens, q, kind, cpus, sum(shares[:j]), start))
             for j, (share, q) in enumerate(zip(shares, queues))]
    for p in procs:
        p.start()
    stamps = [s for q in queues for s in q.get()]
    for p in procs:
        p.join()
    return stamps


def fake_device(engine, device_s: float, calls: list[float]) -> None:
    from kdaserve.engine.model_runner import StepResult
    from kdaserve.engine.step_inputs import build_host_step

    runner = engine.runner
    busy_until = [0.0]

    def execute(batch, input_source=None):
        now = time.monotonic()
        if not batch.prefills:
            calls.append(now)
        step = build_host_step(batch, runner.block_size, trash_row=runner.caches.trash_row)
        busy_until[0] = max(now, busy_until[0]) + device_s
        seqs = step.logits.sample_seqs
        tokens = [TEXT[s.num_output_tokens % len(TEXT)] for s in seqs]
        return StepResult(_FakePendingSample(tokens, busy_until[0]), seqs, [])

    runner.execute = execute


def stamp_steps(engine, calls: list[float]) -> None:
    execute = engine.runner.execute

    def stamped(batch, *source):
        if not batch.prefills:
            calls.append(time.monotonic())
        return execute(batch, *source)

    engine.runner.execute = stamped


class StepTrace:
    """`--trace`: where the engine process's time goes, step by step. Per step: its start, the
    engine's step() (scheduling, launching, reading the previous step's tokens, outputs), the part of it spent
    waiting for the device (the sampled tokens' copy), the part in the model runner's execute (host metadata,
    copies, graph replay or eager launches, logits, sampling: on a GPU the host work a fake device leaves
    out), and, in the server, the engine core's whole step (step() plus encoding the outputs and writing them
    to the API processes' pipes). The benchmark asks for the rows by creating PATH.req; a thread of the
    engine process answers by writing PATH (JSON) and starts over."""

    def __init__(self, path: str | None):
        self.path, self.rows, self.wait, self.step_s, self.execute = path, [], 0.0, 0.0, 0.0

    def install(self, engine, in_server: bool) -> None:
        from kdaserve.engine import sampler

        global _active_trace
        _active_trace = trace = self
        result = sampler.PendingSample.result

        def timed_result(pending):
            if pending._result is not None:
                return result(pending)
            t0 = time.perf_counter()
            try:
                return result(pending)
            finally:
                trace.wait += time.perf_counter() - t0

        sampler.PendingSample.result = timed_result
        execute = engine.runner.execute

        def timed_execute(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return execute(*args, **kwargs)
            finally:
                trace.execute += time.perf_counter() - t0

        engine.runner.execute = timed_execute
        step = engine.step

        def timed_step():
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return step()
            finally:
                trace.step_s = time.perf_counter() - t0
                if not in_server:
                    trace.rows.append((t0, trace.step_s, trace.step_s, trace.wait, time.thread_time() - c0, trace.execute))
                    trace.wait = trace.execute = 0.0

        engine.step = timed_step
        if in_server:
            from kdaserve.engine import engine_process

            core_step = engine_process._EngineCore._step

            def timed_core_step(core, rejections):
                t0, c0 = time.perf_counter(), time.thread_time()
                trace.wait = trace.execute = 0.0
                try:
                    return core_step(core, rejections)
                finally:
                    trace.rows.append((t0, time.perf_counter() - t0, trace.step_s, trace.wait, time.thread_time() - c0,
                                       trace.execute))

            engine_process._EngineCore._step = timed_core_step
            threading.Thread(target=self._answer, daemon=True).start()

    def _answer(self) -> None:
        req = Path(self.path + ".req")
        while True:
            time.sleep(0.02)
            if req.exists():
                rows, self.rows = self.rows, []
                tmp = Path(self.path + ".tmp")
                tmp.write_text(json.dumps(rows))
                tmp.rename(self.path)
                req.unlink()

    @staticmethod
    def ask(path: str) -> list:
        """The rows since the last ask (from the benchmark's process)."""
        out = Path(path)
        out.unlink(missing_ok=True)
        Path(path + ".req").touch()
        deadline = time.monotonic() + 10
        while not out.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the engine process did not answer the trace request")
            time.sleep(0.01)
        return json.loads(out.read_text())

    @staticmethod
    def summary(rows: list) -> dict:
        """Medians in ms over the steps: the period between step starts, the engine core's step,
        the engine's step(), the device wait in it, the runner's execute in it (its host work but
        for a fake device), what the core adds (encode + pipe writes), the host work (core step
        less the wait), the CPU time the engine's thread got in the core step
        (below the host work: the thread waited for a core or for the GIL; equal: it ran slower)
        and the time between steps (inbox, waking)."""
        if len(rows) < 3:
            return {}
        med = lambda xs: statistics.median(xs) * 1e3   # noqa: E731
        starts = [r[0] for r in rows]
        periods = [b - a for a, b in zip(starts, starts[1:])]
        return {"period": med(periods), "core_step": med([r[1] for r in rows]), "engine_step": med([r[2] for r in rows]),
                "device_wait": med([r[3] for r in rows]), "execute": med([r[5] for r in rows]),
                "encode_send": med([r[1] - r[2] for r in rows]),
                "host": med([r[1] - r[3] for r in rows]), "core_cpu": med([r[4] for r in rows]),
                "between": med([p - r[1] for p, r in zip(periods, rows)]), "steps": len(rows)}


_active_trace: StepTrace | None = None   # the fake device's waits count as device waits too
TRACE_COLUMNS = ("period", "core_step", "engine_step", "device_wait", "execute", "encode_send", "host", "core_cpu",
                 "between")


def trace_cells(summary: dict) -> str:
    return " | ".join(f"{summary[c]:.2f}" if c in summary else "-" for c in TRACE_COLUMNS)


def prepare(engine, device_s: float | None, calls: list[float] | None = None, trace: str | None = None,
            in_server: bool = True):
    """The fixed device time (`device_s`) or the real device warmed up, steps stamped into `calls`;
    `trace`: a StepTrace answering at that path."""
    calls = [] if calls is None else calls
    if device_s is not None:
        fake_device(engine, device_s, calls)
    else:
        engine.warm_up()
        stamp_steps(engine, calls)
    if trace is not None:
        engine.step_trace = StepTrace(trace)
        engine.step_trace.install(engine, in_server)
    return engine


def alone_main(kwargs: dict, device_s: float | None, streams: int, max_tokens: int, out: mp.Queue,
               trace: bool = False, profile: int = 0) -> None:
    from kdaserve.engine.llm_engine import LLMEngine

    calls: list[float] = []
    engine = prepare(LLMEngine(**kwargs), device_s, calls, trace="alone" if trace else None, in_server=False)
    alone = engine_alone(engine, streams, max_tokens, calls)
    if profile:   # a second run under cProfile: where the engine's host time goes, per step
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        engine_alone(engine, streams, max_tokens, calls)
        prof.disable()
        print(f"\nThe engine alone under cProfile ({streams} streams x {max_tokens} tokens; times inflated by the "
              f"profiler): top {profile} by own time, then by cumulative time", flush=True)
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(profile)
        stats.sort_stats("cumulative").print_stats(profile)
    out.put((alone, StepTrace.summary(engine.step_trace.rows) if trace else {}))


def median_ms(seconds: list[float]) -> float:
    """The median in ms; NaN for no samples (a round whose streams never all ran at once)."""
    return statistics.median(seconds) * 1e3 if seconds else float("nan")


def p90_ms(seconds: list[float]) -> float:
    return statistics.quantiles(seconds, n=10)[-1] * 1e3 if len(seconds) > 1 else float("nan")


def warn_if_no_window(round_: int, itl: list[float]) -> None:
    if len(itl) < 2:
        print(f"round {round_}: {len(itl)} intervals in the steady window (every stream past its first chunk, "
              f"none ended): too short a round for its ITL (NaN); raise --max-tokens", flush=True)


def loop_cpu_seconds(loop) -> float:
    """CPU time of the event loop's thread so far (read on that thread)."""
    done, box = threading.Event(), []
    loop.call_soon_threadsafe(lambda: (box.append(time.thread_time()), done.set()))
    done.wait(10)
    return box[0]


def stamp_outputs(engine_loop, calls: list[float]) -> None:
    """An engine in its own process: stamp each step's outputs as the server receives them (the
    same period in steady decode, where every step yields one output per stream)."""
    take = engine_loop._take_step

    def stamped(wires, *rest):
        if wires:
            calls.append(time.monotonic())
        return take(wires, *rest)

    engine_loop._take_step = stamped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--device-ms", type=float, default=2.5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None,
                    help="serve this model for real on the device (e.g. bench on a GPU) instead of the fixed device time")
    ap.add_argument("--profile", default=None, help="write a pstats file of the event loop's thread (last round)")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine in its own process, as `kdaserve serve` runs it (default); --no-engine-process: "
                         "a thread of the server's process. The engine step is then stamped where its outputs arrive")
    ap.add_argument("--client", choices=["raw", "httpx", "openai"], default="raw",
                    help="the streaming client: a lean asyncio one (default), httpx's, or the OpenAI SDK's (a real client)")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="client processes the streams are split over (a slow per-chunk client, such as the OpenAI "
                         "SDK's, needs several to keep up with 64 streams)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's async scheduling (default on, as served); --no-async-scheduling: one step at a time")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="API server processes sharing the engine process (kdaserve serve --api-server-count); with "
                         "more than one, the steps are not stamped (ITL against the engine alone) and the CPU per chunk "
                         "is the API processes' together")
    ap.add_argument("--pin", action="store_true",
                    help="pin the engine process to two cores, each API process to one, the client to the rest "
                         "(taken through the several-API-processes path, also with one): does the OS's placement "
                         "of processes explain the spread between invocations?")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the engine's --stream-interval (tokens per streamed chunk; ITL is then per chunk)")
    ap.add_argument("--profile-alone", type=int, default=0, metavar="N",
                    help="print the N functions with the most time of a second run of the engine alone under cProfile")
    ap.add_argument("--trace", action="store_true",
                    help="time the engine process's steps: step(), its device wait, encoding and pipe writes, between "
                         "steps (taken through the several-API-processes path, also with one)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval in ms for this run (Python's default: 5 ms)")
    args = ap.parse_args()
    from kdaserve.engine.llm_engine import LLMEngine

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)

    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    calls: list[float] = []
    if args.model is None:
        kwargs = dict(model="nano", kda_prefill_backend="reference", kda_decode_backend="reference",
                      max_num_seqs=args.streams, max_model_len=args.max_tokens + 64, device="cpu", enforce_eager=True, seed=0)
        device_s = args.device_ms / 1e3
    else:   # the real model on this machine's device, CUDA graphs as served
        kwargs = dict(model=args.model, max_num_seqs=args.streams, max_model_len=args.max_tokens + 64, seed=0)
        device_s = None
    kwargs["async_scheduling"] = args.async_scheduling
    kwargs["stream_interval"] = args.stream_interval
    ctx = mp.get_context("spawn")
    if args.engine_process:
        from kdaserve.engine.engine_process import EngineProcess

        # The bar in a process of its own (one engine on the device at a time), then the served one.
        q = ctx.Queue()
        p = ctx.Process(target=alone_main, args=(kwargs, device_s, args.streams, args.max_tokens, q, args.trace,
                                                 args.profile_alone))
        p.start()
        alone, alone_trace = q.get()
        p.join()
        if args.api_server_count > 1 or args.pin or args.trace:
            return api_servers_main(args, kwargs, device_s, alone, alone_trace)
        engine = EngineProcess(kwargs, setup=functools.partial(prepare, device_s=device_s), log_level="WARNING")
        app = build_app(engine)
        stamp_outputs(app.state.server.engine_loop, calls)
    else:
        engine = prepare(LLMEngine(**kwargs), device_s, calls)
        alone = engine_alone(engine, args.streams, args.max_tokens, calls)
        app = build_app(engine)
    rows = []
    loop_profile = None
    with BackgroundServer(app) as srv:
        # One round not reported (as with several API processes): past the first requests' costs.
        run_client(srv.url, engine.info.model_name, args.streams, 16, args.client, processes=args.client_processes)
        for r in range(args.rounds):
            if args.profile and r == args.rounds - 1:   # the event loop's thread, last round only
                loop_profile = cProfile.Profile()
                srv.server.servers[0].get_loop().call_soon_threadsafe(loop_profile.enable)
            calls.clear()
            loop = srv.server.servers[0].get_loop()
            cpu0 = loop_cpu_seconds(loop), time.process_time()
            stamps = run_client(srv.url, engine.info.model_name, args.streams, args.max_tokens, args.client,
                               processes=args.client_processes)
            chunks = sum(len(s) for s in stamps)
            loop_us, process_us = ((loop_cpu_seconds(loop) - cpu0[0]) / chunks * 1e6,
                                   (time.process_time() - cpu0[1]) / chunks * 1e6)
            # Steady decode: the steps while every stream is past its first token and none has ended.
            first = max(s[1] for s in stamps if len(s) > 1)
            last = min(s[-2] for s in stamps if len(s) > 1)
            steps = [b - a for a, b in zip(calls, calls[1:]) if first <= a and b <= last]
            itl = [b - a for s in stamps for a, b in zip(s, s[1:]) if first <= a and b <= last]
            # Per stream, its mean interval over the window: unlike the median of single intervals,
            # it does not drop to ~0 when a server that falls behind writes several chunks at once.
            tpot = [(w[-1] - w[0]) / (len(w) - 1) for s in stamps if len(w := [t for t in s if first <= t <= last]) > 1]
            step, med, p90, mean = median_ms(steps), median_ms(itl), p90_ms(itl), median_ms(tpot)
            warn_if_no_window(r, itl)
            rows.append((r, len(steps), step, med, p90, mean, loop_us, process_us))
            print(json.dumps({"round": r, "steps": len(steps), "step_ms": step, "itl_median_ms": med, "itl_p90_ms": p90,
                              "stream_mean_itl_ms": mean, "loop_cpu_us_per_chunk": loop_us,
                              "server_process_cpu_us_per_chunk": process_us}), flush=True)
            if loop_profile is not None:
                srv.server.servers[0].get_loop().call_soon_threadsafe(loop_profile.disable)
                time.sleep(0.2)
                loop_profile.dump_stats(args.profile)
    what = f"model {args.model}" if args.model else f"device time {args.device_ms} ms per step"
    what += ", engine in its own process" if args.engine_process else ", engine in a thread of the server"
    print(f"\n{args.streams} streams, {args.max_tokens} tokens each, {what} (this host); "
          f"the engine alone (no server, same batch): {alone:.2f} ms per step")
    print("| round | steady steps | engine step in the server ms | ITL median ms | ITL p90 ms | ITL / engine alone "
          "| stream mean ITL ms (median of streams) | mean ITL / engine alone | event loop CPU µs per chunk "
          "| server process CPU µs per chunk |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r, n, step, med, p90, mean, loop_us, process_us in rows:
        print(f"| {r} | {n} | {step:.2f} | {med:.2f} | {p90:.2f} | {med / alone:.2f}x | {mean:.2f} | {mean / alone:.2f}x "
              f"| {loop_us:.1f} | {process_us:.1f} |")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux: /proc)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_sockets(pid: int) -> int:
    """Sockets a process holds now (Linux: /proc): its listening one and its connections."""
    import os

    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto `cpus` (Linux: sched_setaffinity applies to one thread, so
    each of /proc/PID/task; threads started later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:   # a thread that ended meanwhile
            pass


def pinning(n: int) -> tuple[set[int], list[set[int]], set[int]]:
    """`--pin`'s split of this process's cores: the engine process two (its loop and the threads
    that copy results), each API process one, the client and this process the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n + 4:
        raise SystemExit(f"--pin needs at least {n + 4} cores (engine 2, one per API process, 2 for the client); "
                         f"this process may use {len(cores)}")
    return set(cores[:2]), [{c} for c in cores[2:2 + n]], set(cores[2 + n:])


def engine_steps(url: str) -> float:
    """Engine steps so far, from /metrics (iteration_tokens_total's count: the first API process
    observes every step)."""
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kdaserve:iteration_tokens_total_count"))


def api_servers_main(args, kwargs: dict, device_s: float | None, alone: float, alone_trace: dict) -> None:
    """The engine process behind `--api-server-count` API server processes (server/api_servers.py).
    Besides the client's view: the engine's mean step period over each round (its steps from
    /metrics over the round's span) and the most connections each API process held at once, sampled
    every 5 ms (so a slow round can be told from an engine that slowed and from streams spread
    unevenly; connections of the previous round still closing count too)."""
    import tempfile

    from kdaserve.engine.engine_process import EngineProcess
    from kdaserve.server.api_servers import APIServers
    from kdaserve.server.launch import free_port

    n = args.api_server_count
    trace = os.path.join(tempfile.mkdtemp(prefix="kdaserve-trace-"), "steps.json") if args.trace else None
    engine = EngineProcess(kwargs, setup=functools.partial(prepare, device_s=device_s, trace=trace), log_level="WARNING",
                           api_clients=n)
    servers = APIServers(engine, n, {}, "127.0.0.1", free_port(), log_level="warning")
    rows = []
    client_cpus = None
    try:
        if not servers.wait_ready():
            raise SystemExit("the API servers did not come up")
        if args.pin:
            engine_cpus, api_cpus, client_cpus = pinning(n)
            pin(engine.process.pid, engine_cpus)
            for proc, cpus in zip(servers.processes, api_cpus):
                pin(proc.pid, cpus)
            pin(os.getpid(), client_cpus)
            print(f"pinned: engine {sorted(engine_cpus)}, API processes {[sorted(c) for c in api_cpus]}, "
                  f"client and benchmark {sorted(client_cpus)}", flush=True)
        # One round not reported: every process past its first requests (imports, schema builds).
        run_client(servers.url, engine.info.model_name, args.streams, 16, args.client, client_cpus, args.client_processes)
        for r in range(args.rounds):
            cpu0 = sum(process_cpu_seconds(p.pid) for p in servers.processes)
            steps0 = engine_steps(servers.url)
            if trace:
                StepTrace.ask(trace)   # the rows so far: dropped
            held = [0] * n
            sampling = threading.Event()

            def sample():
                while not sampling.wait(0.005):
                    for i, proc in enumerate(servers.processes):
                        held[i] = max(held[i], open_sockets(proc.pid) - 1)   # less the listening socket

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            stamps = run_client(servers.url, engine.info.model_name, args.streams, args.max_tokens, args.client, client_cpus,
                                args.client_processes)
            sampling.set()
            sampler.join()
            steps_trace = StepTrace.summary(StepTrace.ask(trace)) if trace else {}
            span = max(s[-1] for s in stamps) - min(s[0] for s in stamps)
            step_ms = span / max(engine_steps(servers.url) - steps0, 1) * 1e3
            chunks = sum(len(s) for s in stamps)
            cpu_s = sum(process_cpu_seconds(p.pid) for p in servers.processes) - cpu0
            cpu_us = cpu_s / chunks * 1e6
            token_us = cpu_s / (args.streams * args.max_tokens) * 1e6
            first = max(s[1] for s in stamps if len(s) > 1)
            last = min(s[-2] for s in stamps if len(s) > 1)
            itl = [b - a for s in stamps for a, b in zip(s, s[1:]) if first <= a and b <= last]
            tpot = [(w[-1] - w[0]) / (len(w) - 1) for s in stamps if len(w := [t for t in s if first <= t <= last]) > 1]
            med, p90, mean = median_ms(itl), p90_ms(itl), median_ms(tpot)
            warn_if_no_window(r, itl)
            rows.append((r, med, p90, mean, cpu_us, step_ms, held, steps_trace, token_us))
            print(json.dumps({"round": r, "itl_median_ms": med, "itl_p90_ms": p90, "stream_mean_itl_ms": mean,
                              "api_processes_cpu_us_per_chunk": cpu_us, "engine_mean_step_ms": step_ms,
                              "connections_per_process": held, "engine_process_trace_ms": steps_trace}), flush=True)
    finally:
        servers.stop()
        if trace:
            import shutil

            shutil.rmtree(os.path.dirname(trace), ignore_errors=True)
    what = f"model {args.model}" if args.model else f"device time {args.device_ms} ms per step"
    print(f"\n{args.streams} streams, {args.max_tokens} tokens each, {what} (this host), engine in its own process, "
          f"{n} API server processes{' (pinned)' if args.pin else ''}; the engine alone (no server, same batch): {alone:.2f} ms "
          "per step")
    print("| round | ITL median ms | ITL p90 ms | ITL / engine alone | stream mean ITL ms (median of streams) "
          "| mean ITL / engine alone | API processes' CPU µs per chunk | per token | engine mean step ms (round) "
          "| most connections per API process |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r, med, p90, mean, cpu_us, step_ms, held, _, token_us in rows:
        print(f"| {r} | {med:.2f} | {p90:.2f} | {med / alone:.2f}x | {mean:.2f} | {mean / alone:.2f}x | {cpu_us:.1f} "
              f"| {token_us:.1f} | {step_ms:.2f} | {' / '.join(map(str, held))} |")
    if trace:
        print("\nThe engine process per step, medians in ms (StepTrace): period between step starts; the core's step "
              "(step() + encoding and pipe writes); step(); its device wait; the runner's execute in it (with a fake "
              "device: the host step only); encode + send; host work (core step less "
              "the wait); the engine thread's CPU time in the core step; between steps.")
        print(f"| round | {' | '.join(TRACE_COLUMNS)} |\n|---|{'---|' * len(TRACE_COLUMNS)}")
        print(f"| alone | {trace_cells(alone_trace)} |")
        for r, *_, steps_trace, _token_us in rows:
            print(f"| {r} | {trace_cells(steps_trace)} |")


def engine_alone(engine, streams: int, max_tokens: int, calls: list[float]) -> float:
    """Median step period of the same engine at the same batch with no server: the issue's bar."""
    from kdaserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(streams):
        engine.add_request(f"alone-{i}", engine.tokenizer.encode(f"# stream {i}\n"), params)
    calls.clear()
    while engine.has_unfinished_requests():
        engine.step()
    return median_ms([b - a for a, b in zip(calls, calls[1:])])


if __name__ == "__main__":
    main()
