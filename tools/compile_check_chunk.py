"""Compile every `chunk` kernel for sm_90 without a GPU and report registers, spills, shared memory.

    python -m tools.compile_check_chunk      # one line per kernel variant, then "ok"

Catches compile-only errors (the interpreter accepts things the compiler rejects) and register
spills before a GPU run. Types are those of a bf16 serving step: fp16 workspace, bf16 gate/beta
logits and output, fp32 state pool. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

from kdaserve.ops.chunk.core import CHUNK, DEFAULT_CONFIG
from kdaserve.ops.chunk.gate import chunk_gate_cumsum_kernel
from kdaserve.ops.chunk.intra import BC, chunk_intra_kernel
from kdaserve.ops.chunk.output import chunk_output_norm_kernel
from kdaserve.ops.chunk.state import chunk_state_pass_kernel
from tools.sm90_compile import ARCH
from tools.sm90_compile import compile_for_sm90 as _compile
from tools.sm90_compile import ptxas_report  # noqa: F401  (re-exported for callers)

# Row strides the launcher sees divisible by 16 in a serving step (pointers always are).
_DIV16_STRIDES = ("stride_y", "stride_b_t", "stride_g1_t", "stride_g2_t", "stride_o_t", "stride_p_slot")


def compile_for_sm90(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int = 2):
    return _compile(fn, types, constexprs, num_warps, num_stages,
                    divisible=lambda name, ty: ty.startswith("*") or name in _DIV16_STRIDES)


def main(H: int = 32, D: int = 128) -> None:
    f16, bf, f32, i32 = "*fp16", "*bf16", "*fp32", "*i32"
    tables = dict(chunks=i32, state_indices=i32, cu_seqlens=i32, seq_first_chunk=i32, has_initial_state="*i1")
    variants = [
        ("gate", chunk_gate_cumsum_kernel, dict(g1=bf, A_log=f32, dt_bias=f32, lower_bound="fp32", gcum=f32),
         dict(H=H, K=D, BT=CHUNK, BOUNDED=True), 4, 2),
    ]
    intra_types = dict(y=f16, beta_logits=bf, gcum=f32, Aqk=f16, akk_scratch=f32, w=f16, u=f16, kg=f16, qg=f16,
                       scale="fp32")
    for exact in (False, True):
        for wide in (False, True):
            for inv, blocked, inv_prec in (("blocked tf32", True, "tf32"), ("subst ieee", False, "ieee")):
                for warps in (4, 8):
                    variants.append((f"intra exact={exact:d} {inv}{' wide' if wide else ''}", chunk_intra_kernel,
                                     intra_types, dict(H=H, K=D, BT=CHUNK, BCC=BC, EXACT_DIAG=exact, PREC="tf32",
                                                       BLOCKED_INV=blocked, INV_PREC=inv_prec, WIDE=wide), warps, 2))
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
        print(f"{name:42s} warps={warps} stages={stages}: {ptxas_report(kernel)}", flush=True)
    print("ok")


if __name__ == "__main__":
    main()
