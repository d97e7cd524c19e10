"""Compile a Triton kernel for sm_90 (H100/H200) on a machine without a GPU, and read its
resources from ptxas and its SASS: the sm_90 case of tools/compile_target.py, for the per-op
reports (tools/compile_check_flash.py, compile_check_fused.py).

Catches compile-only errors (the interpreter accepts things the compiler rejects) and register
spills before any GPU time is spent. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from collections.abc import Callable

import triton

from tools.compile_target import compile_for, default_divisible, resources

ARCH = 90


def compile_for_sm90(fn, types: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                     divisible: Callable[[str, str], bool] = default_divisible, maxnreg: int | None = None):
    return compile_for(fn, types, constexprs, "sm_90", num_warps, num_stages, divisible, maxnreg)


def ptxas_report(kernel) -> str:
    """'regs=.. spill_st=.. smem=..' from ptxas -v on the kernel's PTX."""
    return resources(kernel, "sm_90").report("sm_90")


# SASS opcodes worth counting for a latency-bound kernel: the barriers and shared-memory traffic of
# layout conversions, shuffles, special-function and tensor-core instructions, global memory.
SASS_CLASSES = ("BAR", "LDS", "STS", "LDSM", "STSM", "SHFL", "MUFU", "HMMA", "HGMMA", "LDG", "STG", "LDL", "STL")


def sass_mix(kernel) -> str:
    """'sass=N BAR=.. LDS=.. ...': the kernel's static instruction count per thread and the count
    of each class in SASS_CLASSES, from nvdisasm of its cubin. A CPU-side proxy for where a
    latency-bound kernel's issue slots go (each static instruction once: loops count once too);
    docs/perf-notes.md quotes it for flash's K1."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    ops = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))
    return f"sass={sum(ops.values())} " + " ".join(f"{c}={ops[c]}" for c in SASS_CLASSES if ops[c])
