"""Compile a Triton kernel for sm_90 (H100/H200) on a machine without a GPU, and read its
resources from ptxas: the shared core of each op's `compile_check` module.

Catches compile-only errors (the interpreter accepts things the compiler rejects) and register
spills before any GPU time is spent. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

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
