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


def _sass(kernel) -> str:
    """The kernel's SASS, from nvdisasm of its cubin."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")


def sass_mix(kernel) -> str:
    """'sass=N BAR=.. LDS=.. ...': the kernel's static instruction count per thread and the count
    of each class in SASS_CLASSES, from nvdisasm of its cubin. A CPU-side proxy for where a
    latency-bound kernel's issue slots go (each static instruction once: loops count once too);
    docs/perf-notes.md quotes it for flash's K1."""
    ops = collections.Counter(m.group(2) for m in _INSTRUCTION.finditer(_sass(kernel)))
    return f"sass={sum(ops.values())} " + " ".join(f"{c}={ops[c]}" for c in SASS_CLASSES if ops[c])


def sass_loops(kernel) -> list[int]:
    """Instructions per thread in each loop of the kernel's SASS (from a backward branch's target
    to the branch), largest first: what one trip costs, where sass_mix counts a loop once (flash's
    K2 runs its body once per chunk)."""
    addresses, labels, pending = [], {}, []
    for line in _sass(kernel).splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.search(line)
        if m:
            address = int(m.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            addresses.append((address, m.group(2), m.group(3)))
    loops = []
    for address, op, operands in addresses:
        target = re.search(r"\((\.L_x_\d+)\)", operands) if op == "BRA" else None
        if target and labels.get(target.group(1), address) < address:   # not the branch-to-self after EXIT
            start = labels[target.group(1)]
            loops.append(sum(1 for a, _, _ in addresses if start <= a <= address))
    return sorted(loops, reverse=True)
