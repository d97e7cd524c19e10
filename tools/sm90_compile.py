"""Compile a Triton kernel for sm_90 (H100/H200) on a machine without a GPU, and read its
resources from ptxas: the shared core of tools/compile_check_*.py.

Catches compile-only errors (the interpreter accepts things the compiler rejects) and register
spills before any GPU time is spent. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import tempfile
from collections.abc import Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ARCH = 90


def default_divisible(name: str, ty: str) -> bool:
    """What the launcher specializes at run time: 16-byte aligned pointers, strides divisible by 16."""
    return ty.startswith("*") or name.startswith("stride")


def compile_for_sm90(fn, types: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                     divisible: Callable[[str, str], bool] = default_divisible):
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    div16 = [p for p in params if p not in constexprs and divisible(p, sig[p])]
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                    attrs={(params.index(p),): [["tt.divisibility", 16]] for p in div16})
    return triton.compile(src, target=GPUTarget("cuda", ARCH, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_report(kernel) -> str:
    """'regs=.. spill_st=.. smem=..' from ptxas -v on the kernel's PTX."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    r = subprocess.run([ptxas, f"-arch=sm_{ARCH}a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    out = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return f"regs={regs.group(1) if regs else '?'} spill_st={spill.group(1) if spill else '?'} smem={kernel.metadata.shared}"


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
