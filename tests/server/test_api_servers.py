"""Several API server processes on one engine process (`kdaserve serve --api-server-count N`,
server/api_servers.py): each connection gets only its own requests' outputs, a connection that
leaves takes only its own requests with it, the served outputs equal one process's, /metrics sums
the processes, the request limit is shared, and the whole server stops cleanly."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from server_helpers import ENGINE_KWARGS

from kdaserve.engine import LLMEngine, SamplingParams
from kdaserve.engine.engine_process import EngineProcess
from kdaserve.server.engine_loop import EngineLoop
from kdaserve.server.launch import free_port


def _recv(client, deadline: float) -> tuple:
    """The next message, or a failure at `deadline` (not a hang)."""
    assert client._outputs.poll(max(deadline - time.monotonic(), 0)), "no message from the engine in time"
    return client.recv()


def _collect(client, want: set[str], timeout: float = 120) -> tuple[dict, list, dict]:
    """Read `client`'s step messages until every request in `want` finished: (request id ->
    output ids, every request id seen, the engine's stats after the last step)."""
    ids, seen, stats = {}, [], None
    deadline = time.monotonic() + timeout
    while want - {r for r, (_, done) in ids.items() if done}:
        message = _recv(client, deadline)
        assert message[0] == "step", message
        stats = message[3]
        for wire in message[1]:
            request_id, new_ids, finished = wire[0], wire[1], wire[5]
            seen.append(request_id)
            old, _ = ids.get(request_id, ([], False))
            ids[request_id] = (old + list(new_ids), finished)
    return {r: v[0] for r, v in ids.items()}, seen, stats


def test_each_connection_gets_its_own_outputs_and_leaving_aborts_only_its_own():
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = {"a": list(b"first prompt"), "b": list(b"second"), "c": list(b"third one here")}
    reference = LLMEngine(**ENGINE_KWARGS)
    want = {}
    for request_id, ids in prompts.items():
        reference.add_request(request_id, ids, params)
    while reference.has_unfinished_requests():
        for out in reference.step():
            if out.finished:
                want[out.request_id] = list(out.output_token_ids)

    engine = EngineProcess(ENGINE_KWARGS, api_clients=2)
    try:
        first, second = engine.clients()
        first.send(("add", "a", prompts["a"], params))
        first.send(("add", "b", prompts["b"], params))
        second.send(("add", "c", prompts["c"], params))
        second.send(("abort", "a"))   # not its own: ignored
        got_first, seen_first, _ = _collect(first, {"a", "b"})
        got_second, seen_second, _ = _collect(second, {"c"})
        assert set(seen_first) == {"a", "b"} and set(seen_second) == {"c"}
        assert got_first == {"a": want["a"], "b": want["b"]} and got_second == {"c": want["c"]}

        # The second API process leaves with a long request running: only that one is aborted.
        second.send(("add", "d", prompts["c"], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)))
        first.send(("add", "e", prompts["a"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)))
        deadline = time.monotonic() + 60
        while True:   # both running
            message = _recv(second, deadline)
            if message[0] == "step" and message[1]:
                break
        second.close()
        while _recv(second, deadline)[0] != "detached":
            pass
        got, _, stats = _collect(first, {"e"})
        assert len(got["e"]) == 30
        # d (70 tokens to go) is not running on: nothing runs once e finished, every slot is back.
        assert (stats["num_running"], stats["num_waiting"], stats["state_slots_used"]) == (0, 0, 0), stats
    finally:
        engine.close()
    assert engine.process.exitcode == 0


def test_the_request_limit_is_shared_by_the_api_servers():
    class Engine:
        info = SimpleNamespace(max_num_seqs=8, tokenizer=None)   # all a loop reads of an engine (EngineInfo)

    assert EngineLoop(Engine(), max_queued_requests=9).max_in_flight == 17
    assert EngineLoop(Engine(), max_queued_requests=9, api_server_count=2).max_in_flight == 8   # 2 x 8 <= 17
    assert EngineLoop(Engine(), max_queued_requests=0, api_server_count=4).max_in_flight == 2
    assert EngineLoop(Engine(), max_queued_requests=0, api_server_count=16).max_in_flight == 1   # never 0


def test_a_burst_of_connections_spreads_over_the_api_servers_sockets():
    """64 connections opened at once land on every one of 3 sockets (each API server process
    accepts on its own): one shared socket would let the first process to wake take them all."""
    import socket

    from kdaserve.server.api_servers import bind_sockets

    sockets = bind_sockets("127.0.0.1", 0, 3)
    clients = []
    try:
        assert len({s.fileno() for s in sockets}) == 3 and len({s.getsockname()[1] for s in sockets}) == 1
        port = sockets[0].getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
        accepted = []
        for s in sockets:
            s.setblocking(False)
            count = 0
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                count += 1
            accepted.append(count)
        assert sum(accepted) == 64 and min(accepted) > 0, accepted
    finally:
        for c in clients:
            c.close()
        for s in sockets:
            s.close()


def _serve(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kdaserve.cli", "serve", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--kda-prefill-backend", "reference", "--kda-decode-backend", "reference", "--max-num-seqs", "8",
           "--max-model-len", "128", "--device", "cpu", "--enforce-eager", "--no-warmup", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def _stream(url: str, i: int) -> str:
    """One streaming completion on a connection of its own; its text."""
    body = {"model": "tiny", "prompt": f"stream {i}: ", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = []
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def test_serve_with_two_api_servers_answers_sums_metrics_and_stops():
    streams = 16
    proc, url = _serve("--api-server-count", "2")
    try:
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            texts = list(pool.map(lambda i: _stream(url, i), range(streams)))
        # The same requests one at a time give the same greedy texts (whichever process served them).
        for i in (0, 7, 15):
            body = {"model": "tiny", "prompt": f"stream {i}: ", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == texts[i]
        # A client that leaves mid-stream: its request is aborted, its slot freed.
        body = {"model": "tiny", "prompt": "left", "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
            next(response.iter_lines())
        # /metrics from either process (connections land on either): the sum over both.
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            done = _metric(text, "kdaserve:request_success_total", finished_reason="length")
            aborted = _metric(text, "kdaserve:request_success_total", finished_reason="abort")
            if (done, aborted) == (streams + 3, 1) and _metric(text, "kdaserve:num_requests_running") == 0:
                break
            assert time.monotonic() < deadline, (done, aborted)
            time.sleep(0.2)
        assert _metric(text, "kdaserve:generation_tokens_total") >= (streams + 3) * 12
        assert _metric(text, "kdaserve:state_slots_used") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read()
        assert "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    """Child processes of `pid` (Linux /proc)."""
    from pathlib import Path

    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return sorted(kids)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return stat[0] != "Z"   # a zombie is dead, only not yet reaped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the API server processes through /proc")
def test_an_api_server_that_dies_stops_the_whole_server():
    """A half-working server would take connections it cannot answer: when one API server process
    dies, the parent stops the other and the engine, and exits 1."""
    import os

    proc, url = _serve("--api-server-count", "2")
    try:
        deadline = time.monotonic() + 60
        while True:   # spawned in order: resource tracker, engine, the API servers (the last two)
            spawned = [k for k in _children(proc.pid) if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]
            if len(spawned) >= 3:
                break
            assert time.monotonic() < deadline, spawned
            time.sleep(0.2)
        os.kill(spawned[-1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        deadline = time.monotonic() + 30
        while any(_alive(k) for k in spawned):
            assert time.monotonic() < deadline, [k for k in spawned if _alive(k)]
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_settings_that_cannot_work_are_refused_with_the_reason():
    import os

    from kdaserve.server.metrics import ServerMetrics

    with pytest.raises(ValueError, match="api_clients must be at least 1, got 0"):
        EngineProcess(ENGINE_KWARGS, api_clients=0)
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        with pytest.raises(ValueError, match="multiprocess metrics need PROMETHEUS_MULTIPROC_DIR"):
            ServerMetrics("tiny", multiprocess=True)


def test_a_port_in_use_is_a_one_line_error():
    """Another program listens on the port: the server says so and exits 1, its engine stopped."""
    import socket

    from kdaserve.server.api_servers import bind_sockets

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_sockets("127.0.0.1", port, 2)
        out = subprocess.run([sys.executable, "-m", "kdaserve.cli", "serve", "tiny", "--device", "cpu", "--enforce-eager",
                              "--no-warmup", "--kda-prefill-backend", "reference", "--kda-decode-backend", "reference",
                              "--host", "127.0.0.1", "--port", str(port), "--api-server-count", "2"],
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 1 and f"kdaserve serve: cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    finally:
        busy.close()


@pytest.mark.parametrize("flags, message", [
    (("--api-server-count", "0"), "--api-server-count must be at least 1, got 0"),
    (("--api-server-count", "2", "--no-engine-process"), "--api-server-count > 1 needs the engine in its own process"),
])
def test_serve_refuses_api_server_counts_that_cannot_work(flags, message):
    out = subprocess.run([sys.executable, "-m", "kdaserve.cli", "serve", "tiny", "--device", "cpu", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_metrics_directories_of_servers_that_died_are_swept(tmp_path):
    """A server killed before its clean stop leaves its prometheus directory behind; the next
    server removes those whose process is gone, and nothing else."""
    import os

    from kdaserve.server.api_servers import METRICS_DIR_PREFIX, sweep_stale_metrics_dirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    dead = tmp_path / f"{METRICS_DIR_PREFIX}{dead_pid}-abc"
    alive = tmp_path / f"{METRICS_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / "kdaserve-metrics-notapid"
    unrelated = tmp_path / f"something-{dead_pid}"
    for d in (dead, alive, other, unrelated):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"x")
    assert sweep_stale_metrics_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and other.exists() and unrelated.exists()
