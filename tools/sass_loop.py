"""Count a kernel's machine instructions per loop trip, on a machine without a GPU: compile
tools/compile_check's cases for an NVIDIA target, disassemble the cubin with the nvdisasm Triton
ships, and count the opcodes of the longest loop (the K loop of a GEMM), per trip and per element
of the weight tile each thread handles when the case names one.

    python -m tools.sass_loop --arch sm_90 --kernels "moe mxfp4"      # name prefixes, comma-separated

What it answers: how much integer / conversion work a weight decode costs per value (the 4-bit
tiles' bf16 decoding was chosen by it: docs/perf-notes.md, thirty-eighth session), whether a
change adds a barrier or a shared-memory round trip inside the loop (BAR, STS / LDS), and where
ptxas packs or swaps register halves (PRMT). It does not time anything: instruction counts guide,
the GPU benchmarks decide.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):   # run as `python tools/sass_loop.py`: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton

from tools.compile_target import compile_for

_OPCODE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def disassemble(kernel) -> str:
    """The SASS of a compiled Triton kernel, by the nvdisasm beside Triton's ptxas."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def longest_loop(sass: str) -> collections.Counter:
    """Opcode counts between a label and the last backward branch to it, for the longest such loop."""
    lines = sass.splitlines()
    best: list[str] = []
    for i, line in enumerate(lines):
        label = re.match(r"(\.L_x_\d+):", line)
        if not label:
            continue
        back = [j for j in range(i + 1, len(lines)) if re.search(r"BRA\s+`\(" + re.escape(label.group(1)) + r"\)", lines[j])]
        if back:
            body = [m.group(1) for m in map(_OPCODE.match, lines[i:back[-1] + 1]) if m]
            best = body if len(body) > len(best) else best
    return collections.Counter(best)


def weight_values_per_thread(consts: dict, warps: int, name: str) -> float | None:
    """Weight-tile values one thread decodes per trip of a GEMM's K loop (BN x BK; gate|up kernels
    two tiles), or None where the case has no such tile."""
    if "BN" not in consts or "BK" not in consts:
        return None
    return consts["BN"] * consts["BK"] * (2 if "gate_up" in name else 1) / (32 * warps)


def main(argv: list[str] | None = None) -> int:
    from tools.compile_check import all_cases

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sm_90", help="an NVIDIA target of tools/compile_target.TARGETS")
    ap.add_argument("--kernels", required=True, help="comma-separated name prefixes of tools/compile_check's cases")
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per kernel")
    args = ap.parse_args(argv)
    if triton.knobs.runtime.interpret:
        sys.exit("run without TRITON_INTERPRET: this compiles for the GPU")
    if not args.arch.startswith("sm_"):
        ap.error("SASS is NVIDIA's: pick an sm_ target")
    for case in all_cases(False, tuple(k for k in args.kernels.split(",") if k)):
        consts, warps, stages = case.launch(args.arch)
        counts = longest_loop(disassemble(compile_for(case.kernel, case.types, consts, args.arch, warps, stages)))
        total = sum(counts.values())
        per = weight_values_per_thread(consts, warps, case.name)
        mma = sum(v for k, v in counts.items() if "MMA" in k)
        per_value = f", {(total - mma) / per:.2f} non-MMA per weight value and thread" if per and total else ""
        print(f"{args.arch} {case.name}: loop {total} instructions{per_value}; "
              + " ".join(f"{k}={v}" for k, v in counts.most_common(args.top)), flush=True)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
