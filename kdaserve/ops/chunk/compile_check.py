"""Compile every `chunk` kernel for sm_90 without a GPU and report registers, spills, shared memory.

    python -m kdaserve.ops.chunk.compile_check      # one line per kernel variant, then "ok"

Catches compile-only errors (the interpreter accepts things the compiler rejects) and register
spills before a GPU run. Types are those of a bf16 serving step: fp16 workspace, bf16 gate/beta
logits and output, fp32 state pool. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kdaserve.ops.chunk.core import CHUNK, DEFAULT_CONFIG
from kdaserve.ops.chunk.gate import chunk_gate_cumsum_kernel
from kdaserve.ops.chunk.intra import BC, chunk_intra_kernel
from kdaserve.ops.chunk.output import chunk_output_norm_kernel
from kdaserve.ops.chunk.state import chunk_state_pass_kernel

ARCH = 90


def compile_for_sm90(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int = 2):
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    # What the launcher specializes at run time: 16-byte aligned pointers, row strides divisible by 16.
    div16 = [p for p in params if p not in constexprs and (sig[p].startswith("*") or p in ("stride_y", "stride_b_t",
                                                                                          "stride_g1_t", "stride_g2_t",
                                                                                          "stride_o_t", "stride_p_slot"))]
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                    attrs={(params.index(p),): [["tt.divisibility", 16]] for p in div16})
    return triton.compile(src, target=GPUTarget("cuda", ARCH, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_report(kernel) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    r = subprocess.run([ptxas, f"-arch=sm_{ARCH}a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    out = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return f"regs={regs.group(1) if regs else '?'} spill_st={spill.group(1) if spill else '?'} smem={kernel.metadata.shared}"


def main(H: int = 32, D: int = 128) -> None:
    f16, bf, f32, i32 = "*fp16", "*bf16", "*fp32", "*i32"
    tables = dict(chunks=i32, state_indices=i32, cu_seqlens=i32, seq_first_chunk=i32, has_initial_state="*i1")
    variants = [
        ("gate", chunk_gate_cumsum_kernel, dict(g1=bf, A_log=f32, dt_bias=f32, lower_bound="fp32", gcum=f32),
         dict(H=H, K=D, BT=CHUNK, BOUNDED=True), 4, 2),
    ]
    for exact in (False, True):
        for warps in (4, 8):
            variants.append((f"intra exact={exact}", chunk_intra_kernel,
                             dict(y=f16, beta_logits=bf, gcum=f32, Aqk=f16, akk_diag=f32, w=f16, u=f16, kg=f16, qg=f16,
                                  scale="fp32"),
                             dict(H=H, K=D, BT=CHUNK, BCC=BC, EXACT_DIAG=exact, PREC="tf32"), warps, 2))
    for bv in (16, 32, 64):
        for warps in (4, 8):
            for stages in (2, 3):
                variants.append((f"state bv={bv}", chunk_state_pass_kernel,
                                 dict(w=f16, u=f16, kg=f16, gcum=f32, v_new=f16, h_states=f16, pool=f32,
                                      stride_p_slot="i64"),
                                 dict(H=H, K=D, BT=CHUNK, BV=bv, PREC="ieee"), warps, stages))
    for warps in (4, 8):
        variants.append(("output", chunk_output_norm_kernel,
                         dict(qg=f16, h_states=f16, Aqk=f16, v_new=f16, g2=bf, norm_w=f32, eps="fp32", out=bf),
                         dict(H=H, K=D, BT=CHUNK, PREC="ieee"), warps, 2))
    print(f"sm_{ARCH}, H={H}, D={D}; default config: {DEFAULT_CONFIG}")
    for name, fn, types, const, warps, stages in variants:
        kernel = compile_for_sm90(fn, {**tables, **types}, const, warps, stages)
        print(f"{name:18s} warps={warps} stages={stages}: {ptxas_report(kernel)}", flush=True)
    print("ok")


if __name__ == "__main__":
    main()
