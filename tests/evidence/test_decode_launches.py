"""benchmarks/decode_launches.py: a Kimi-Linear decode step's launches as a GPU makes them, counted
on the CPU. Pinned from above: a change that adds launches to a decode step fails here, so it is
made on purpose (then raise the bound with the reason) and not by accident."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Launches per layer kind (fused SwiGLU, the shared expert run inside the fused MoE kernels at
# decode, the MLA cache write with its norm in one launch) and for the whole released model's step.
MOST = {"KDA + dense MLP": 9, "KDA + MoE": 13, "MLA + MoE": 17}
MOST_RELEASED = 382


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records launches through Triton's interpreter")
def test_kimi_linear_decode_step_launches_no_more_than_pinned():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_launches.py"), "--batch", "2"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {cells[1].strip(): cells for line in r.stdout.splitlines() if line.startswith("| ")
            for cells in [line.split("|")]}
    for kind, most in MOST.items():
        per_layer = float(rows[kind][2])
        assert per_layer <= most, f"{kind}: {per_layer:g} launches per layer, pinned at {most}: {rows[kind][3]}"
    assert "silu" not in r.stdout and "index_copy_" not in r.stdout   # the fused paths ran
    assert "swiglu_kernel" not in rows["KDA + MoE"][3]                # the shared expert ran as an expert
    released = float(rows["total"][6])
    assert 0 < released <= MOST_RELEASED, r.stdout
