"""Soak test of `kdaserve serve` (not in CI): well-behaved streaming clients for `--minutes`, first
alone (clean), then beside abusive ones (attacked): slowloris connections, 20 MB bodies, prompts
past the character limit, streams whose clients read nothing, and clients that hang up after their
first token. Prints a table per phase and minute: server RSS, p50/p99 inter-token latency of the
well-behaved streams, 5xx answers anyone got, and at the end the state slots and KV blocks still
in use once the server is idle (leaks). Goals (issue 23): attacked p99 within 1.2x of clean, no
5xx, no leaked slot.

    python tools/soak_server.py --minutes 10               # the issue's run (20 minutes in all)
    python tools/soak_server.py --minutes 1 --streams 4    # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Tally:
    def __init__(self):
        self.gaps: list[float] = []
        self.server_errors = 0
        self.completed = 0


async def good_stream(base: str, tally: Tally, stop: float, i: int) -> None:
    body = {"model": "tiny", "prompt": f"Well-behaved client {i} says", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        while time.monotonic() < stop:
            last = None
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code >= 500:
                    tally.server_errors += 1
                    await asyncio.sleep(0.5)
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        now = time.monotonic()
                        if last is not None:
                            tally.gaps.append(now - last)
                        last = now
            tally.completed += 1


async def slowloris(host: str, port: int, stop: float, n: int) -> None:
    async def one():
        while time.monotonic() < stop:
            try:
                reader, writer = await asyncio.open_connection(host, port)
                for byte in b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(1.0)
                    if reader.at_eof() or time.monotonic() > stop:
                        break
                writer.close()
            except OSError:
                await asyncio.sleep(1.0)

    await asyncio.gather(*(one() for _ in range(n)))


async def abusive_requests(base: str, tally: Tally, stop: float) -> None:
    huge = b'{"model": "tiny", "prompt": "' + b"x" * (20 << 20) + b'"}'
    long_text = {"model": "tiny", "prompt": "y" * (1 << 20), "max_tokens": 2}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        while time.monotonic() < stop:
            for send in (lambda: http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}),
                         lambda: http.post("/v1/completions", json=long_text)):
                try:
                    r = await send()
                    tally.server_errors += r.status_code >= 500
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(2.0)


async def non_readers(host: str, port: int, stop: float, n: int) -> None:
    body = json.dumps({"model": "tiny", "prompt": "never read", "max_tokens": 512, "ignore_eos": True,
                       "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body

    async def one():
        while time.monotonic() < stop:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(s, (host, port))
                await asyncio.get_running_loop().sock_sendall(s, request)
                await asyncio.sleep(30)
            except OSError:
                pass
            finally:
                s.close()

    await asyncio.gather(*(one() for _ in range(n)))


async def hang_ups(base: str, tally: Tally, stop: float) -> None:
    body = {"model": "tiny", "prompt": "hang up soon", "max_tokens": 64, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        while time.monotonic() < stop:
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    tally.server_errors += r.status_code >= 500
                    async for _ in r.aiter_lines():
                        break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)


async def phase(name: str, base: str, pid: int, args, attacked: bool) -> list[dict]:
    host, port = "127.0.0.1", int(base.rsplit(":", 1)[1])
    rows = []
    tally = Tally()
    end = time.monotonic() + 60 * args.minutes
    tasks = [asyncio.create_task(good_stream(base, tally, end, i)) for i in range(args.streams)]
    if attacked:
        tasks += [asyncio.create_task(slowloris(host, port, end, args.slowloris)),
                  asyncio.create_task(abusive_requests(base, tally, end)),
                  asyncio.create_task(non_readers(host, port, end, args.non_readers)),
                  asyncio.create_task(hang_ups(base, tally, end))]
    minute = 0
    while time.monotonic() < end:
        await asyncio.sleep(min(60, max(0.1, end - time.monotonic())))
        minute += 1
        gaps, tally.gaps = tally.gaps, []
        q = statistics.quantiles(gaps, n=100) if len(gaps) >= 2 else [float("nan")] * 99
        rows.append({"phase": name, "minute": minute, "rss": rss_mib(pid), "p50": 1e3 * q[49], "p99": 1e3 * q[98],
                     "streams": tally.completed, "5xx": tally.server_errors})
        print(f"  {name} minute {minute}: RSS {rows[-1]['rss']:.0f} MiB, p99 {rows[-1]['p99']:.1f} ms", flush=True)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return rows


def idle_usage(base: str, timeout: float = 120) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(base + "/metrics").text

        def value(name):
            m = re.search(rf"^kdaserve:{name}{{[^}}]*}} (\S+)", text, re.M)
            return float(m.group(1)) if m else float("nan")

        running, waiting = value("num_requests_running"), value("num_requests_waiting")
        if (running == 0 and waiting == 0) or time.monotonic() > deadline:
            return value("state_slots_used"), value("kv_blocks_used")
        time.sleep(1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--streams", type=int, default=8, help="well-behaved streaming clients")
    p.add_argument("--slowloris", type=int, default=200)
    p.add_argument("--non-readers", type=int, default=8)
    p.add_argument("--stream-write-timeout", type=float, default=10)
    args = p.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "kdaserve.cli", "serve", "--model", "tiny", "--device", "cpu", "--port", str(port),
         "--max-num-seqs", "32", "--max-model-len", "1024", "--log-level", "warning",
         "--stream-write-timeout", str(args.stream_write_timeout)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        rows = asyncio.run(phase("clean", base, server.pid, args, attacked=False))
        rows += asyncio.run(phase("attacked", base, server.pid, args, attacked=True))
        slots, blocks = idle_usage(base)
    finally:
        server.terminate()
        server.wait(30)
    print(f"\nkdaserve serve --model tiny (CPU), {args.streams} well-behaved streams of 32 tokens; attacked: "
          f"{args.slowloris} slowloris connections, 20 MB bodies and 1 M-character prompts every 2 s, "
          f"{args.non_readers} non-reading streams, hang-ups after the first token")
    print("| phase | minute | server RSS MiB | ITL p50 ms | ITL p99 ms | streams done | 5xx |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['minute']} | {r['rss']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | {r['streams']} "
              f"| {r['5xx']} |")
    clean = [r["p99"] for r in rows if r["phase"] == "clean"]
    attacked = [r["p99"] for r in rows if r["phase"] == "attacked"]
    print(f"\np99 attacked / clean (medians over minutes): {statistics.median(attacked) / statistics.median(clean):.2f}x; "
          f"state slots in use when idle: {slots:.0f}; KV blocks in use when idle: {blocks:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
