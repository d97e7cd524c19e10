"""Compile the MLA and MoE kernels for sm_90 on a CPU at Kimi-Linear's serving shapes and print
their resources (registers, spills, shared memory): python -m tools.compile_check_kimi

Exits non-zero if a kernel fails to compile or spills."""

from __future__ import annotations

import sys

import triton.language as tl

from kdaserve.ops.mla.decode import _mla_decode_kernel
from kdaserve.ops.mla.prefill import _mla_prefill_kernel
from kdaserve.ops.moe.fused import _moe_down_kernel, _moe_gate_up_kernel
from tools.sm90_compile import compile_for_sm90, ptxas_report

BF16 = "*bf16"


def checks():
    yield ("mla decode L=512 R=64 H16", _mla_decode_kernel,
           dict(ql_ptr=BF16, qp_ptr=BF16, cache_ptr=BF16, tables_ptr="*i32", lens_ptr="*i32", out_ptr=BF16, scale="fp32"),
           dict(H=32, L=512, R=64, BLOCK_H=16, BLOCK_SIZE=16, TILE=32, PREC="tf32"), 8, 3)   # as launched
    yield ("mla prefill Dn=128 R=64 Dv=128", _mla_prefill_kernel,
           dict(qn_ptr=BF16, qp_ptr=BF16, kn_ptr=BF16, kp_ptr=BF16, v_ptr=BF16, out_ptr=BF16, blk_seq_ptr="*i32",
                blk_start_ptr="*i32", cu_q_ptr="*i32", cu_k_ptr="*i32", scale="fp32"),
           dict(DN=128, R=64, DV=128, BLOCK_M=64, BLOCK_N=32, PREC="tf32"), 8, 2)
    for bm in (16, 32, 64):
        yield (f"moe gate_up BM={bm}", _moe_gate_up_kernel,
               dict(x_ptr=BF16, w_ptr=BF16, sorted_ptr="*i32", experts_ptr="*i32", h_ptr=BF16),
               dict(TOPK=8, LIMIT=0.0, HAS_LIMIT=False, BM=bm, BN=64, BK=64, PREC="tf32"), 4, 3)   # as launched
        yield (f"moe down BM={bm}", _moe_down_kernel,
               dict(h_ptr=BF16, w_ptr=BF16, sorted_ptr="*i32", experts_ptr="*i32", weights_ptr="*fp32", y_ptr=BF16),
               dict(BM=bm, BN=64, BK=64, PREC="tf32"), 4, 3)


def main() -> int:
    bad = 0
    for name, fn, types, consts, warps, stages in checks():
        try:
            report = ptxas_report(compile_for_sm90(fn, types, consts, num_warps=warps, num_stages=stages))
        except Exception as exc:  # noqa: BLE001 - report every kernel
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            bad += 1
            continue
        spills = "spill_st=0" not in report
        bad += spills
        print(f"{name}: {report}{'  SPILLS' if spills else ''}")
    if not bad:
        print("ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
