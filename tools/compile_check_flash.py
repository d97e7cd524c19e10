"""Compile every flash kernel for sm_90 without a GPU and report its resources (ptxas -v).

    python -m tools.compile_check_flash          # prints one line per kernel variant, then "ok"
    python -m tools.compile_check_flash --sass   # also each kernel's SASS instruction mix and loop bodies

Catches compile-only errors (the interpreter accepts things the compiler rejects) and shows
registers, spills, shared memory and whether the big dots became Hopper wgmma, before a GPU run.
Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl

from kdaserve.ops.kda.flash.config import DEFAULT_CONFIG as CONFIG
from kdaserve.ops.kda.flash.correct import flash_correct_kernel
from kdaserve.ops.kda.flash.plan import flash_plan_kernel
from kdaserve.ops.kda.flash.prepare import flash_prepare_kernel
from kdaserve.ops.kda.flash.recurrence import flash_recurrence_kernel
from kdaserve.ops.kda.flash.scan import flash_scan_kernel
from tools.sm90_compile import compile_for_sm90, ptxas_report, sass_loops, sass_mix


def main(sass: bool = False) -> None:
    def report(kernel) -> str:
        if not sass:
            return ptxas_report(kernel)
        loops = sass_loops(kernel)
        return f"{ptxas_report(kernel)} {sass_mix(kernel)}" + (f" loop bodies={loops}" if loops else "")

    f16, bf, f32, i32, b1 = "*fp16", "*bf16", "*fp32", "*i32", "*i1"
    ws = dict(w_ptr=f16, u_ptr=f16, qg_ptr=f16, kd_ptr=f16, aqk_ptr=f16, gam_ptr=f32)
    tables = dict(cu_ptr=i32, idx_ptr=i32, init_ptr=b1, chunk_seq_ptr=i32, chunk_tok_ptr=i32,
                  seg_seq_ptr=i32, seg_tok_ptr=i32, seg_end_ptr=i32, seg_chunk_ptr=i32, seq_seg0_ptr=i32)
    lines = []

    cfg = CONFIG
    k = compile_for_sm90(flash_plan_kernel, dict(tables, cu_ptr=i32), dict(C=16, BLOCK_J=32, BLOCK_N=64))
    lines.append(f"plan: {report(k)}")

    # (C, bounded, first chunks, nested, K1's dot operand types): every launch prefill.py makes (the
    # unbounded gate: clamped, one anchor at C = 16 or joined halves at 32, or nested), with the
    # register cap it launches with; the one-anchor and joined-halves launches with fp16 operands
    # (FlashConfig.prepare_half_dots, the default) and with tf32 ones (the nested pass takes neither)
    both = (tl.float16, tl.float32)
    cases = [(32, True, False, False, both), (32, True, True, False, both), (16, False, False, False, both),
             (16, False, True, False, both), (32, False, False, False, both), (32, False, True, False, both),
             (16, False, False, True, both[:1]), (16, False, True, True, both[:1]), (32, False, False, True, both[:1])]

    def prepare_line(C, bounded, first, nested, inv_dt) -> str:
        k = compile_for_sm90(
            flash_prepare_kernel,
            dict(**ws, **tables, qkv_ptr=bf, forget_ptr=bf, b_ptr=bf, cw_ptr=f32, cs_ptr=bf, a_log_ptr=f32, dt_bias_ptr=f32,
                 lower_bound="fp32", q_scale="fp32", decay_clamp="fp32", T="i32"),
            dict(H=32, D=128, C=C, LOG2C=C.bit_length() - 1, W=4, BOUNDED=bounded, PREC_TC="tf32", FAST=True, FIRST=first,
                 NFIRST=1, NESTED=nested, INV_DT=inv_dt, PREFETCH=CONFIG.prepare_prefetch,
                 stride_cs_ch=1, stride_forget_d=1, stride_cw_j=1),  # unit strides: as launched
            num_warps=cfg.prepare_warps,
            maxnreg=(cfg.prepare_maxnreg if bounded else cfg.unbounded_prepare_maxnreg) or None,
        )
        kind = "bounded" if bounded else ("nested" if nested else "clamped")
        return f"prepare C={C} {kind} first={first}{' tf32-dots' if inv_dt == tl.float32 else ''}: {report(k)}"

    for C, bounded, first, nested, inv_dt in ((*c[:4], dt) for c in cases for dt in c[4]):
        lines.append(prepare_line(C, bounded, first, nested, inv_dt))

    rec_types = dict(**ws, **tables, s_ptr=f32, o_ptr=bf, out_gate_ptr=bf, nw_ptr=f32, eps="fp32", oq_ptr=f16, bm_ptr=f32,
                     qkv_ptr=bf, cs_ptr=bf, q_off="i64")
    checkpoints = dict(ck_off_ptr=i32, ck_slot_ptr=i32, ck_maps_ptr=f32)   # prefix caching's variants (NCK > 0)
    for C in (16, 32):
        for seg, bv, warps, stages in ((False, 128, cfg.recur_warps, cfg.recur_stages),
                                       (True, cfg.seg_block_v, cfg.seg_warps, cfg.seg_stages)):
            for nck in (0, 4):
                k = compile_for_sm90(flash_recurrence_kernel, dict(rec_types, **checkpoints),
                                     dict(H=32, D=128, C=C, BV=bv, SEGMENTED=seg, L_PAD=4, PREC="tf32", FAST=True, NCK=nck,
                                          CK_PIECES=cfg.checkpoint_pieces),
                                     num_warps=warps, num_stages=stages)
                wg = "wgmma" if "wgmma" in k.asm["ptx"] else "mma.sync"
                lines.append(f"recurrence C={C} segmented={seg} BV={bv} warps={warps} NCK={nck}: {report(k)} {wg}")

    for nck in (0, 4):
        k = compile_for_sm90(flash_scan_kernel, dict(bm_ptr=f32, start_ptr=f32, s_ptr=f32, idx_ptr=i32, seq_seg0_ptr=i32,
                                                     **checkpoints),
                             dict(H=32, D=128, BV=cfg.scan_block_v, PREC="tf32x3", NCK=nck), num_warps=cfg.scan_warps,
                             num_stages=cfg.scan_stages)
        lines.append(f"scan NCK={nck}: {report(k)}")

    k = compile_for_sm90(flash_correct_kernel,
                         dict(oq_ptr=f16, start_ptr=f32, o_ptr=bf, out_gate_ptr=bf, nw_ptr=f32, eps="fp32", cu_ptr=i32,
                              idx_ptr=i32,
                              seg_seq_ptr=i32, seg_tok_ptr=i32, seg_end_ptr=i32, q_off="i64"),
                         dict(H=32, D=128, C=16, CPG=cfg.correct_chunks, DOT_DTYPE=tl.float16, PREC="tf32", FAST=True),
                         num_warps=cfg.correct_warps)
    lines.append(f"correct: {report(k)}")
    print("\n".join(lines))
    print("ok")


if __name__ == "__main__":
    if triton.knobs.runtime.interpret:
        sys.exit("run without TRITON_INTERPRET: this compiles for the GPU")
    main(sass="--sass" in sys.argv[1:])
