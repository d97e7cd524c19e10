"""Run a compile check in Triton's compiled mode from a test suite that runs the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def run_compiled(args: list[str], timeout: int = 600) -> str:
    """`python <args>` without TRITON_INTERPRET (so Triton compiles for the GPU target, ptxas
    included, on a machine without a GPU); the script must print "ok" last. Skips the calling test
    when this Triton build has no NVIDIA backend; fails it with the script's stderr otherwise.
    Returns stdout."""
    import pytest

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    if "No module named" in r.stderr and "nvidia" in r.stderr:
        pytest.skip("this triton build has no NVIDIA backend")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    return r.stdout
