"""benchmarks/bench_serving_host.py runs end to end on the CPU (fake device) with the options the
GPU runs use (several API processes, the engine process's step trace, a stream interval), and
prints its tables: a benchmark that crashes after minutes of device time costs the whole run (a
round too short for a steady window, which the host's timing decides, prints NaN, not a crash)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serving_benchmark_prints_its_tables_with_trace_and_stream_interval():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serving_host.py"), "--rounds", "1", "--streams",
                        "4", "--max-tokens", "16", "--device-ms", "1", "--api-server-count", "2", "--trace",
                        "--stream-interval", "2"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| round | ITL median ms"))
    assert lines[head + 2].startswith("| 0 | ") and lines[head + 2].count("|") == lines[head].count("|")
    trace = next(i for i, line in enumerate(lines) if line.startswith("| round | period"))
    assert lines[trace + 2].startswith("| alone | ") and lines[trace + 3].startswith("| 0 | ")
    assert "-" not in lines[trace + 3].split("|")[2]   # the round's trace has its numbers
