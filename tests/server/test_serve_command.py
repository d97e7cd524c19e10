"""`kdaserve serve` as a person runs it: a subprocess that listens, answers, and stops on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from kdaserve.server.launch import free_port


def _wait_healthy(proc, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def test_serve_command_answers_and_stops_on_sigint():
    """vLLM's spelling: the model as a positional argument, an API key, CORS for one origin."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "kdaserve.cli", "serve", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--api-key", "k-1", "--allowed-origins", "http://app.example",
        "--kda-prefill-backend", "reference", "--kda-decode-backend", "reference", "--max-num-seqs", "4",
        "--max-model-len", "128", "--device", "cpu", "--enforce-eager", "--no-warmup", "--log-level", "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        key = {"Authorization": "Bearer k-1"}
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        model = httpx.get(f"{url}/v1/models", headers=key, timeout=10).json()["data"][0]
        assert (model["id"], model["max_model_len"]) == ("tiny", 128)
        pre = httpx.options(f"{url}/v1/completions", timeout=10, headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.headers.get("access-control-allow-origin") == "http://app.example", (pre.status_code, dict(pre.headers))
        other = httpx.options(f"{url}/v1/completions", timeout=10, headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        out = httpx.post(f"{url}/v1/completions", json=body, headers=key, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_timeouts_that_are_not_positive():
    """Checked before the engine is built: a one-line error naming the flag, exit status 2."""
    for flag in ("--header-timeout", "--timeout-keep-alive", "--stream-write-timeout"):
        out = subprocess.run([sys.executable, "-m", "kdaserve.cli", "serve", "tiny", flag, "0"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and f"kdaserve serve: {flag} must be seconds > 0, got 0.0" in out.stderr, out.stderr


def test_serve_refuses_tool_flags_that_cannot_work():
    """--enable-auto-tool-choice without a parser, and a parser whose tokens the model's tokenizer
    lacks (the byte tokenizer has no Kimi tool-call tokens): exit status 2 with the reason."""
    run = lambda *flags: subprocess.run([sys.executable, "-m", "kdaserve.cli", "serve", "tiny", "--device", "cpu", *flags],  # noqa: E731
                                        capture_output=True, text=True, timeout=300)
    out = run("--enable-auto-tool-choice")
    assert out.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in out.stderr, out.stderr
    out = run("--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2")
    assert out.returncode == 2 and "lacks <|tool_calls_section_begin|>" in out.stderr, out.stderr


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing children of `pid` (the engine process), not its resource tracker."""
    out = subprocess.run(["ps", "-ww", "--ppid", str(pid), "-o", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def _killed_ends_the_server(extra: list[str], victim, said: list[str]) -> None:
    """Start `kdaserve serve tiny` on the CPU (`extra` flags), SIGKILL the process `victim(server
    pid)` names once it is healthy: the server exits 1 within 10 s, saying each line of `said`,
    with no traceback."""
    port = free_port()
    cmd = [sys.executable, "-m", "kdaserve", "serve", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", "4", "--max-model-len", "128", "--device", "cpu", "--no-warmup", "--log-level", "warning",
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}")
        pid = victim(proc.pid)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        assert time.monotonic() - killed < 10
        out = proc.stdout.read()
        assert all(line in out for line in said) and "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _only(pids: list[int]) -> int:
    assert len(pids) == 1, pids
    return pids[0]


def test_a_dead_tensor_parallel_rank_ends_the_server_with_its_error():
    """`serve -tp 2` (two CPU ranks over gloo): when rank 1 dies the engine process ends itself naming
    the rank (a collective would wait for it forever), and the server exits non-zero within seconds,
    as when the engine process itself dies."""
    _killed_ends_the_server(["-tp", "2"], lambda server: _only(_spawned_children(_only(_spawned_children(server)))),
                            ["kdaserve-tp-rank-1 exited (exit code -9); the engine stops",
                             "kdaserve serve: the engine stopped (the engine process exited (exit code 1)); exiting"])


def test_a_dead_engine_process_ends_the_server_with_its_error():
    """As vLLM's server: when the engine process dies the server exits non-zero, saying why, within
    seconds, so that a supervisor restarts it rather than a server answering 503 forever."""
    _killed_ends_the_server(["--kda-prefill-backend", "reference", "--kda-decode-backend", "reference"],
                            lambda server: _only(_spawned_children(server)),
                            ["kdaserve serve: the engine stopped (the engine process exited (exit code -9)); exiting"])
