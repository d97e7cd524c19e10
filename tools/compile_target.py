"""Compile a Triton kernel for a GPU architecture on a machine without a GPU, and read its resources.

Targets: NVIDIA `sm_89`, `sm_90`, `sm_100` (ptxas -v: registers, spill stores, shared memory) and
AMD `gfx942`, `gfx950` (the code object's metadata: VGPRs, AGPRs, SGPRs, spills, scratch, LDS).
Must run without TRITON_INTERPRET. tools/sm90_compile.py is the sm_90 case of this.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGETS = ("sm_89", "sm_90", "sm_100", "gfx942", "gfx950")
# Shared memory (NVIDIA, per block, opt-in maximum) or LDS (AMD, per workgroup), bytes.
SHARED_LIMIT = {"sm_89": 99 * 1024, "sm_90": 227 * 1024, "sm_100": 227 * 1024, "gfx942": 64 * 1024, "gfx950": 160 * 1024}


def gpu_target(target: str) -> GPUTarget:
    if target.startswith("sm_"):
        return GPUTarget("cuda", int(target[3:]), 32)
    if target.startswith("gfx"):
        return GPUTarget("hip", target, 64)
    raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")


def default_divisible(name: str, ty: str) -> bool:
    """What the launcher specializes at run time: 16-byte aligned pointers, strides divisible by 16
    (named `stride*` or `s_*`). A stride left unmarked gives another build than the GPU's (loads
    not pipelined, other registers and spills)."""
    return ty.startswith("*") or name.startswith(("stride", "s_"))


def compile_for(fn, types: dict, constexprs: dict, target: str, num_warps: int = 4, num_stages: int = 3,
                divisible=default_divisible, maxnreg: int | None = None):
    signature = inspect.signature(fn.fn).parameters
    params = list(signature)
    # A constexpr parameter with a default (an option launchers leave out) takes its default, as at
    # a launch that does not pass it.
    constexprs = {**{p: v.default for p, v in signature.items() if p not in constexprs and p not in types
                     and v.default is not inspect.Parameter.empty and "constexpr" in str(v.annotation)},
                  **constexprs}
    sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    div16 = [p for p in params if p not in constexprs and divisible(p, sig[p])]
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                    attrs={(params.index(p),): [["tt.divisibility", 16]] for p in div16})
    return triton.compile(src, target=gpu_target(target), options=dict(num_warps=num_warps, num_stages=num_stages,
                                                                          **({"maxnreg": maxnreg} if maxnreg else {})))


@dataclass
class Resources:
    registers: int          # per thread (NVIDIA) or VGPRs + AGPRs per lane (AMD)
    spill_bytes: int        # NVIDIA: spill stores; AMD: VGPR + SGPR spills plus scratch
    shared_bytes: int       # shared memory / LDS per block
    sgprs: int | None = None
    # NVIDIA: ptxas serialized the kernel's wgmma (its warning C7515: every wgmma waits for the last)
    wgmma_serialized: bool = False

    def report(self, target: str) -> str:
        if target.startswith("sm_"):
            return f"regs={self.registers} spill_st={self.spill_bytes} smem={self.shared_bytes}"
        return f"vgprs={self.registers} sgprs={self.sgprs} spill/scratch={self.spill_bytes} lds={self.shared_bytes}"


def resources(kernel, target: str) -> Resources:
    if target.startswith("sm_"):
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(int(target[3:])).path   # the one Triton compiles with (Blackwell has its own)
        arch = target[3:] + ("a" if target in ("sm_90", "sm_100") else "")
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
        os.unlink(f.name)
        out = r.stdout + r.stderr
        if r.returncode:
            raise RuntimeError(f"ptxas failed for {target}: {out[-500:]}")
        regs = re.search(r"Used (\d+) registers", out)
        spill = re.search(r"(\d+) bytes spill stores", out)
        return Resources(int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else 0, kernel.metadata.shared,
                         wgmma_serialized="wgmma.mma_async instructions are serialized" in out)
    asm = kernel.asm["amdgcn"]

    def field(name: str) -> int:
        m = re.search(re.escape(name) + r":\s*(\d+)", asm)
        return int(m.group(1)) if m else 0

    spills = field(".vgpr_spill_count") + field(".sgpr_spill_count") + field(".private_segment_fixed_size")
    lds = max(kernel.metadata.shared, field(".group_segment_fixed_size"))
    return Resources(field(".vgpr_count") + field(".agpr_count"), spills, lds, sgprs=field(".sgpr_count"))


def occupancy(res: Resources, target: str, num_warps: int) -> str:
    """Programs per SM (NVIDIA: 64K registers, the shared limit) or waves per SIMD (AMD: 512
    unified VGPRs per lane, at most 8 waves), as registers and shared memory allow."""
    if target.startswith("sm_"):
        by_regs = 65536 // max(1, res.registers * 32 * num_warps)
        by_smem = SHARED_LIMIT[target] // max(1, res.shared_bytes)
        return f"progs/SM<={min(by_regs, by_smem, 32)}"
    return f"waves/SIMD<={min(8, 512 // max(1, res.registers))}"
