"""Compile every Triton kernel of kdaserve at its serving launch shapes for a GPU architecture, on a
machine without a GPU, and check it fits.

    python -m tools.compile_check --arch sm_90          # or sm_89, sm_100, gfx942, gfx950
    python -m tools.compile_check --arch all            # or a list: --arch gfx950,gfx942
    python -m tools.compile_check --arch gfx950 --quick # one shape per kernel (what CI compiles)
    python -m tools.compile_check --arch all --markdown # also docs/portability.md's table, last

One line per kernel and shape: registers (VGPRs + AGPRs and SGPRs on AMD), spills or scratch,
shared memory / LDS, occupancy. Exits non-zero if a kernel fails to compile, spills where the sm_90
build does not, or needs more shared memory / LDS than the target has (tools/compile_target.py
lists the limits). fp32 dots take the target's precision (kdaserve/ops/precision.py): `tc` and
`exact` below stand for its tensor-core and exact choices. Shapes: bf16 serving steps, H = 32
KDA heads of 128, Kimi-Linear's MLA and MoE sizes. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):   # run as `python tools/compile_check.py`: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
import triton.language as tl

from kdaserve.ops.precision import precision_for_target
from tools.compile_target import SHARED_LIMIT, TARGETS, Resources, compile_for, occupancy, resources

BF, F16, F32, I32, B1 = "*bf16", "*fp16", "*fp32", "*i32", "*i1"


@dataclass
class Case:
    name: str
    kernel: object
    types: dict
    consts: dict
    warps: int = 4
    stages: int = 3
    quick: bool = False          # part of the one-shape-per-kernel set
    no_spill: bool = False       # must not spill on any target, sm_90 included
    precision: dict = field(default_factory=dict)   # constexpr -> "tc" | "exact"
    # The launch where a target differs, by target-name prefix ("gfx", "gfx942"):
    # {"consts": {...}, "warps": n, "stages": n}, as the kernel's wrapper chooses it there.
    per_target: dict = field(default_factory=dict)
    # Targets (name prefixes) the kernel is never launched on: its wrapper refuses them first.
    not_on: tuple[str, ...] = ()

    def launch(self, target: str) -> tuple[dict, int, int]:
        """(constexprs, warps, stages) as the wrapper launches the kernel on `target`."""
        consts, warps, stages = self.constexprs(target), self.warps, self.stages
        for prefix, o in self.per_target.items():
            if target.startswith(prefix):
                consts = {**consts, **o.get("consts", {})}
                warps, stages = o.get("warps", warps), o.get("stages", stages)
        return consts, warps, stages

    def constexprs(self, target: str) -> dict:
        p = precision_for_target(target)
        consts = {**self.consts, **{k: (p.tensor_core if role == "tc" else p.exact) for k, role in self.precision.items()}}
        if "FAST" in consts:   # the PTX fast-math paths: NVIDIA only, as at run time (flash/fastmath.py)
            consts["FAST"] = target.startswith("sm_")
        return consts


def _mla_decode_launch(shape: tuple[int, int, int]) -> dict:
    tile, warps, stages = shape
    return dict(consts=dict(TILE=tile), warps=warps, stages=stages)


def _dense_mla_decode_launch(shape: tuple[int, int, int, int]) -> dict:
    tile, warps, stages, block_h = shape
    return dict(consts=dict(TILE=tile, BLOCK_H=block_h), warps=warps, stages=stages)


def _mla_prefill_launch(shape: tuple[int, int, int, int]) -> dict:
    block_m, block_n, warps, stages = shape
    return dict(consts=dict(BLOCK_M=block_m, BLOCK_N=block_n), warps=warps, stages=stages)


def _prepare_consts(cfg, target: str) -> dict:
    """K1's operand type for the inverse's products and its L1 prefetch (PTX: NVIDIA only), as
    prefill.py launches it on `target` with a 16-bit workspace."""
    return dict(INV_DT=tl.float16 if cfg.prepare_half_dots else tl.float32,
                PREFETCH=cfg.prepare_prefetch and target.startswith("sm_"))


def _recurrence_launch(cfg, segmented: bool) -> dict:
    consts = dict(CK_PIECES=cfg.checkpoint_pieces)
    if segmented:
        return dict(consts=consts, warps=cfg.seg_warps, stages=cfg.seg_stages)
    return dict(consts=consts, warps=cfg.recur_warps, stages=cfg.recur_stages)


def _flash_cases() -> list[Case]:
    from kdaserve.ops.kda.flash.config import DEFAULT_CONFIG as cfg
    from kdaserve.ops.kda.flash.config import config_for_target
    from kdaserve.ops.kda.flash.correct import flash_correct_kernel
    from kdaserve.ops.kda.flash.plan import flash_plan_kernel
    from kdaserve.ops.kda.flash.prepare import flash_prepare_kernel
    from kdaserve.ops.kda.flash.recurrence import flash_recurrence_kernel
    from kdaserve.ops.kda.flash.scan import flash_scan_kernel

    ws = dict(w_ptr=F16, u_ptr=F16, qg_ptr=F16, kd_ptr=F16, aqk_ptr=F16, gam_ptr=F32)
    tables = dict(cu_ptr=I32, idx_ptr=I32, init_ptr=B1, chunk_seq_ptr=I32, chunk_tok_ptr=I32, seg_seq_ptr=I32,
                  seg_tok_ptr=I32, seg_end_ptr=I32, seg_chunk_ptr=I32, seq_seg0_ptr=I32)
    out = [Case("flash plan", flash_plan_kernel, tables, dict(C=32, BLOCK_J=32, BLOCK_N=64), quick=True)]
    prep_types = dict(**ws, **tables, qkv_ptr=BF, forget_ptr=BF, b_ptr=BF, cw_ptr=F32, cs_ptr=BF, a_log_ptr=F32,
                      dt_bias_ptr=F32, lower_bound="fp32", q_scale="fp32", decay_clamp="fp32", T="i32")
    # (name, C, bounded, first chunks, nested): every launch prefill.py makes (the unbounded gate:
    # clamped, one anchor at C = 16 or joined halves at 32, or nested), as each target launches them
    # (_prepare_consts).
    for name, C, bounded, first, nested, quick in (
            ("C=32 bounded", 32, True, False, False, True),
            ("C=32 bounded first chunks", 32, True, True, False, False),
            ("C=16 unbounded clamped", 16, False, False, False, True),
            ("C=16 unbounded clamped first chunks", 16, False, True, False, False),
            ("C=32 unbounded clamped (joined halves)", 32, False, False, False, False),
            ("C=32 unbounded clamped (joined halves) first chunks", 32, False, True, False, False),
            ("C=16 unbounded nested", 16, False, False, True, False),
            ("C=16 unbounded nested first chunks", 16, False, True, True, False),
            ("C=32 unbounded nested", 32, False, False, True, False)):
        out.append(Case(f"flash prepare {name}", flash_prepare_kernel, prep_types,
                        dict(H=32, D=128, C=C, LOG2C=C.bit_length() - 1, W=4, BOUNDED=bounded, FAST=False, FIRST=first,
                             NFIRST=1, NESTED=nested, stride_cs_ch=1, stride_forget_d=1, stride_cw_j=1),
                        warps=cfg.prepare_warps, quick=quick, precision={"PREC_TC": "tc"},
                        per_target={t: dict(consts=_prepare_consts(config_for_target(t), t)) for t in TARGETS}))
    rec_types = dict(**ws, **tables, s_ptr=F32, o_ptr=BF, out_gate_ptr=BF, nw_ptr=F32, eps="fp32", oq_ptr=F16,
                     bm_ptr=F32, qkv_ptr=BF, cs_ptr=BF, q_off="i64")
    rec_types.update(ck_off_ptr=I32, ck_slot_ptr=I32, ck_maps_ptr=F32)
    # NCK = 4: the state checkpoints of prefix caching (four per sequence), compiled in.
    for C, seg, bv, warps, stages, nck in ((32, False, 128, cfg.recur_warps, cfg.recur_stages, 0),
                                           (32, True, cfg.seg_block_v, cfg.seg_warps, cfg.seg_stages, 0),
                                           (32, False, 128, cfg.recur_warps, cfg.recur_stages, 4),
                                           (32, True, cfg.seg_block_v, cfg.seg_warps, cfg.seg_stages, 4)):
        out.append(Case(f"flash recurrence C={C} segmented={seg}{' checkpoints' if nck else ''}", flash_recurrence_kernel,
                        rec_types, dict(H=32, D=128, C=C, BV=bv, SEGMENTED=seg, L_PAD=4, FAST=False, NCK=nck), warps,
                        stages, quick=not seg and not nck, precision={"PREC": "tc"},
                        per_target={t: _recurrence_launch(config_for_target(t), seg) for t in TARGETS}))
    for nck in (0, 4):
        out.append(Case(f"flash scan{' checkpoints' if nck else ''}", flash_scan_kernel,
                        dict(bm_ptr=F32, start_ptr=F32, s_ptr=F32, idx_ptr=I32, seq_seg0_ptr=I32, ck_off_ptr=I32,
                             ck_slot_ptr=I32, ck_maps_ptr=F32, SL="i32"),
                        dict(H=32, D=128, BV=cfg.scan_block_v, NCK=nck), cfg.scan_warps, cfg.scan_stages, quick=not nck,
                        precision={"PREC": "exact"}))
    out.append(Case("flash correct", flash_correct_kernel,
                    dict(oq_ptr=F16, start_ptr=F32, o_ptr=BF, out_gate_ptr=BF, nw_ptr=F32, eps="fp32", cu_ptr=I32, idx_ptr=I32,
                         seg_seq_ptr=I32, seg_tok_ptr=I32, seg_end_ptr=I32, q_off="i64"),
                    dict(H=32, D=128, C=32, CPG=cfg.correct_chunks, DOT_DTYPE=tl.float16, FAST=False), cfg.correct_warps,
                    quick=True, precision={"PREC": "tc"}))
    return out


def _decode_cases() -> list[Case]:
    from kdaserve.ops.kda.fused.decode import STREAM_BF16, STREAM_BF16_AMD, STREAM_FP32, FusedDecodeConfig
    from kdaserve.ops.kda.fused.decode_kernel import kda_fused_decode_kernel
    from kdaserve.ops.kda.fused.stream_kernel import kda_fused_stream_kernel
    from kdaserve.ops.kda.recurrent.kernel import kda_recurrent_kernel

    def fused_types(state):
        return dict(qkv=BF, forget_logits=BF, beta_logits=BF, output_gate_logits=BF, conv_w=F32, A_log=F32, dt_bias=F32,
                    norm_w=F32, conv_state=BF, state=state, state_indices=I32, spec_indices=I32, num_accepted=I32, out=BF,
                    ws_o=I32, ws_count=I32, lower_bound="fp32", norm_eps="fp32")

    out = []
    for name, cfg, state, tokens, quick in (("bv8 w1", FusedDecodeConfig(8, 1), F32, 1, True),
                                            ("bv64 w4", FusedDecodeConfig(64, 4), F32, 1, False),
                                            ("bv32 w4 bf16 state", FusedDecodeConfig(32, 4), BF, 1, False),
                                            ("verify S=3 bv8 w1", FusedDecodeConfig(8, 1), F32, 4, False)):
        out.append(Case(f"fused decode {name}", kda_fused_decode_kernel, fused_types(state),
                        dict(H=32, D=128, L=3 + tokens - 1, TOKENS=tokens, SCALE=128**-0.5, IS_SPEC=tokens > 1,
                             BOUNDED_GATE=True, BV=cfg.block_v, WIN_REGS=cfg.block_v <= 16, STORE_FIRST=False),
                        cfg.num_warps, quick=quick))
    for name, cfg, state in (("stream fp32", STREAM_FP32, F32), ("stream bf16", STREAM_BF16, BF)):
        types = {k: v for k, v in fused_types(state).items() if k not in ("spec_indices", "num_accepted", "ws_o", "ws_count")}
        amd = {"gfx": dict(consts=dict(BV=STREAM_BF16_AMD.block_v, STAGES=STREAM_BF16_AMD.stages))} if state == BF else {}
        out.append(Case(f"fused {name}", kda_fused_stream_kernel, types,
                        dict(H=32, D=128, L=3, SCALE=128**-0.5, BOUNDED_GATE=False, BV=cfg.block_v, PREFETCH=cfg.prefetch,
                             STAGES=cfg.stages, WIN_REGS=bool(cfg.window_regs)), cfg.num_warps, quick=state == F32,
                        per_target=amd))
    out.append(Case("chain recurrence bv32 w4", kda_recurrent_kernel,
                    dict(y_ptr=BF, g_ptr=BF, b_ptr=BF, s_ptr=F32, o_ptr=BF, a_log_ptr=F32, dt_bias_ptr=F32, idx_ptr=I32,
                         spec_ptr=I32, acc_ptr=I32, lower_bound="fp32", scale="fp32"),
                    dict(M=1, K=128, V=128, BV=32, IS_SPEC=False, BOUNDED=True), quick=True))
    return out


def _other_cases() -> list[Case]:
    from kdaserve.ops.activation.swiglu import launch_shape as swiglu_shape
    from kdaserve.ops.activation.swiglu import swiglu_kernel
    from kdaserve.ops.attention.paged_decode import _paged_decode_kernel
    from kdaserve.ops.dsa.triton_scores import dsa_index_scores_kernel
    from kdaserve.ops.hyper_connection.triton_hc import hc_post_kernel, hc_pre_kernel
    from kdaserve.ops.kda.conv.update import BLOCK_C as UPDATE_BC
    from kdaserve.ops.kda.conv.update_kernel import conv_update_kernel
    from kdaserve.ops.kda.conv.varlen import BLOCK_C, BLOCK_T, NUM_WARPS
    from kdaserve.ops.kda.conv.varlen_kernel import conv_varlen_out_kernel, conv_varlen_state_kernel
    from kdaserve.ops.mla.decode import _mla_decode_kernel, _mla_merge_kernel, dense_launch, launch_shape
    from kdaserve.ops.mla.latent_write import mla_latent_write_kernel
    from kdaserve.ops.mla.prefill import _mla_prefill_kernel
    from kdaserve.ops.mla.prefill import launch_shape as mla_prefill_shape
    from kdaserve.ops.mla.sparse_decode import _mla_sparse_decode_kernel
    from kdaserve.ops.moe.align import _align_count_kernel, _align_offsets_kernel, _align_per_expert_kernel, _align_place_kernel
    from kdaserve.ops.moe.fused import _moe_sum_kernel
    from kdaserve.ops.moe.router_kernel import _route_kernel
    from kdaserve.ops.norm.gated_rms_norm import gated_rms_norm_kernel
    from kdaserve.ops.norm.rms_norm import launch_shape as rms_norm_shape
    from kdaserve.ops.norm.rms_norm import rms_norm_kernel

    out = [
        Case("conv varlen out", conv_varlen_out_kernel,
             dict(x_ptr=BF, w_ptr=F32, state_ptr=BF, y_ptr=BF, cu_ptr=I32, idx_ptr=I32, his_ptr=B1, block_seq_ptr=I32,
                  block_t0_ptr=I32), dict(W=4, BT=BLOCK_T, BC=BLOCK_C), NUM_WARPS, quick=True),
        Case("conv varlen state", conv_varlen_state_kernel,
             dict(x_ptr=BF, state_ptr=BF, cu_ptr=I32, idx_ptr=I32, his_ptr=B1), dict(BL=4, BC=BLOCK_C), quick=True),
        Case("conv update", conv_update_kernel,
             dict(x_ptr=BF, w_ptr=F32, state_ptr=BF, y_ptr=BF, idx_ptr=I32, acc_ptr=I32),
             dict(W=4, BM=2, BL=4, BC=UPDATE_BC, HAS_ACCEPTED=False), quick=True),
        Case("rms norm + residual D=2304", rms_norm_kernel,
             dict(x_ptr=BF, r_ptr=BF, w_ptr=BF, y_ptr=BF, ro_ptr=BF, eps="fp32"),
             dict(HAS_RESIDUAL=True, BR=rms_norm_shape(2304)[0], BD=rms_norm_shape(2304)[1]), rms_norm_shape(2304)[2],
             quick=True, no_spill=True),
        Case("swiglu I=1024", swiglu_kernel, dict(x_ptr=BF, y_ptr=BF, limit="fp32"),
             dict(HAS_LIMIT=False, BR=swiglu_shape(1024)[0], BI=swiglu_shape(1024)[1]), quick=True, no_spill=True),
        Case("swiglu I=9216 clamped", swiglu_kernel, dict(x_ptr=BF, y_ptr=BF, limit="fp32"),
             dict(HAS_LIMIT=True, BR=swiglu_shape(9216)[0], BI=swiglu_shape(9216)[1]), no_spill=True),
        Case("mla latent write L=512 R=64", mla_latent_write_kernel,
             dict(kv_ptr=BF, w_ptr=BF, cache_ptr=BF, slots_ptr="*i64", eps="fp32"), dict(BL=512, BR=64, HAS_PE=True),
             quick=True, no_spill=True),
        Case("mla latent write L=512 no rotary part", mla_latent_write_kernel,
             dict(kv_ptr=BF, w_ptr=BF, cache_ptr=BF, slots_ptr="*i64", eps="fp32"), dict(BL=512, BR=1, HAS_PE=False),
             no_spill=True),
        Case("gated rms norm", gated_rms_norm_kernel, dict(o_ptr=BF, g_ptr=BF, w_ptr=F32, y_ptr=BF, idx_ptr=I32, eps="fp32"),
             dict(HAS_INDEX=False, BR=16, BD=128), quick=True),
        Case("paged decode attention D=128 G=4", _paged_decode_kernel,
             dict(q_ptr=BF, k_ptr=BF, v_ptr=BF, tables_ptr=I32, lens_ptr=I32, out_ptr=BF, scale="fp32"),
             dict(HKV=4, G=4, GP=16, D=128, BLOCK_SIZE=16, TILE=64), quick=True, precision={"PREC": "tc"}),
    ]
    # GLM-5.3-Flash: hyper-connections (4 streams), DSA index scores (128-wide index heads), MLA
    # over the chosen rows (latent 512, no rotary part).
    out += [
        Case("hc pre N=4", hc_pre_kernel, dict(s_ptr=BF, raw_ptr=F32, base_ptr=F32, scale_ptr=F32, post_ptr=F32,
                                               comb_ptr=F32, x_ptr=BF, hc_eps="fp32", norm_eps="fp32"),
             dict(N=4, ITERS=20, BD=1024), quick=True, no_spill=True),
        Case("hc post N=4", hc_post_kernel, dict(s_ptr=BF, out_ptr=BF, post_ptr=F32, comb_ptr=F32, y_ptr=BF),
             dict(N=4, BD=256), quick=True, no_spill=True),
        Case("dsa index scores Di=128", dsa_index_scores_kernel,
             dict(q_ptr=BF, w_ptr=F32, k_ptr=BF, pos_ptr="*i64", out_ptr=F32, scale="fp32"),
             dict(DI=128, BM=64, BP=64, IEEE=False), quick=True),
        Case("mla sparse decode L=512 R=0", _mla_sparse_decode_kernel,
             dict(ql_ptr=BF, qp_ptr=BF, cache_ptr=BF, tables_ptr=I32, idx_ptr=I32, out_ptr=BF, scale="fp32"),
             dict(H=64, L=512, R=16, HAS_PE=False, BLOCK_H=16, BLOCK_SIZE=16), quick=True, precision={"PREC": "tc"},
             no_spill=True, per_target={t: _mla_decode_launch(launch_shape(t, 512)) for t in TARGETS}),
    ]
    # Dense MLA at Kimi-Linear's sizes (32 heads, rotary part 64, 128-wide heads) and GLM-5.3-Flash's
    # (64 heads, no rotary part, 256-wide heads), each launched as its wrapper launches it.
    for H, R, dn in ((32, 64, 128), (64, 0, 256)):
        # The Hopper shape (dense_launch) spills a few bytes on sm_90 and was still the fastest
        # measured; the others must not spill (the check compares them with sm_90's build only
        # where that has none, so it is not marked no_spill).
        for split in (False, True):   # one launch; flash decoding's partials (then the merge)
            out.append(Case(f"mla decode L=512 R={R}{' split' if split else ''}", _mla_decode_kernel,
                            dict(ql_ptr=BF, qp_ptr=BF, cache_ptr=BF, tables_ptr=I32, lens_ptr=I32, out_ptr=BF,
                                 part_ptr=F32, lse_ptr=F32, scale="fp32"),
                            dict(H=H, L=512, R=max(R, 16), HAS_PE=R > 0, BLOCK_SIZE=16, SPLIT=split),
                            quick=True, precision={"PREC": "tc"},
                            per_target={t: _dense_mla_decode_launch(dense_launch(t, 512)) for t in TARGETS}))
        # The Hopper shape at 256-wide heads spills 12 bytes on sm_90 and was the fastest measured
        # (ops/mla/prefill.launch_shape): not marked no_spill; the other targets' shapes must not.
        bm, bn, warps, stages = mla_prefill_shape("sm_90", dn, dn)
        out.append(Case(f"mla prefill Dn={dn} R={R} Dv={dn}", _mla_prefill_kernel,
                        dict(qn_ptr=BF, qp_ptr=BF, kn_ptr=BF, kp_ptr=BF, v_ptr=BF, out_ptr=BF, blk_seq_ptr=I32,
                             blk_start_ptr=I32, cu_q_ptr=I32, cu_k_ptr=I32, scale="fp32"),
                        dict(DN=dn, R=max(R, 16), HAS_PE=R > 0, DV=dn, BLOCK_M=bm, BLOCK_N=bn), warps, stages, quick=True,
                        precision={"PREC": "tc"}, no_spill=dn <= 128,
                        per_target={t: _mla_prefill_launch(mla_prefill_shape(t, dn, dn)) for t in TARGETS}))
    out.append(Case("mla decode merge L=512", _mla_merge_kernel, dict(part_ptr=F32, lse_ptr=F32, out_ptr=BF),
                    dict(H=32, L=512, SPLITS=64), quick=True, no_spill=True))
    # extra 1: the shared expert's column appended (layers/moe at decode); one row per program at
    # decode sizes, 16 at prefill's
    for extra, bt in ((0, 16), (1, 16), (1, 1)):
        out.append(Case(f"moe route E=256 k=8{' + shared expert' if extra else ''} BT={bt}", _route_kernel,
                        dict(logits_ptr=F32, bias_ptr=F32, w_ptr=F32, ids_ptr="*i64", scale="fp32"),
                        dict(K=8, K_P=8, E_P=256, BT=bt, SOFTMAX=False, HAS_BIAS=True, RENORMALIZE=True, EXTRA=extra),
                        4, 1, quick=not extra, no_spill=True))
    # Ling-3's grouped routing: 512 experts in 8 groups, 4 open (decode rows, and prefill's 4 rows of 512)
    for bt in (1, 4):
        out.append(Case(f"moe route E=512 k=8 grouped 4 of 8 + shared expert BT={bt}", _route_kernel,
                        dict(logits_ptr=F32, bias_ptr=F32, w_ptr=F32, ids_ptr="*i64", scale="fp32"),
                        dict(K=8, K_P=8, E_P=512, BT=bt, SOFTMAX=False, HAS_BIAS=True, RENORMALIZE=True, EXTRA=1,
                             GROUPS=8, TOPK_GROUPS=4, GROUP_SIZE=64, G_P=8), 4, 1, quick=bt == 1, no_spill=True))
    out.append(Case("moe sum over k=8 + shared experts", _moe_sum_kernel, dict(y_ptr=BF, out_ptr=BF, add_ptr=BF),
                    dict(TOPK=8, BT=4, BH=256, HAS_ADD=True), 4,
                    quick=True, no_spill=True))
    out.append(Case("moe align per expert E=256 + shared expert, 576 slots", _align_per_expert_kernel,
                    dict(ids_ptr="*i64", sorted_ptr=I32, block_experts_ptr=I32),
                    dict(E_P=512, S_P=1024, FILL=256), 4, 1, quick=True, no_spill=True))
    out.append(Case("moe align per expert E=256 + shared expert, 4096 slots", _align_per_expert_kernel,
                    dict(ids_ptr="*i64", sorted_ptr=I32, block_experts_ptr=I32),
                    dict(E_P=512, S_P=4096, FILL=256), 4, 1, no_spill=True))
    # Prefill's alignment over blocks of slots (align._align_by_blocks): count, offsets, place.
    out.append(Case("moe align blocks count E=256", _align_count_kernel,
                    dict(ids_ptr="*i64", counts_ptr=I32, sorted_ptr=I32), dict(E=256, E_P=256, BLOCK_S=32), 4, 1,
                    quick=True, no_spill=True))
    out.append(Case("moe align blocks offsets E=256", _align_offsets_kernel,
                    dict(counts_ptr=I32, base_ptr=I32, block_experts_ptr=I32),
                    dict(E=256, E_P=256, BM=128, BLOCK_S=32, BLOCK_B=16), 4, 1, quick=True, no_spill=True))
    out.append(Case("moe align blocks place E=256", _align_place_kernel,
                    dict(ids_ptr="*i64", base_ptr=I32, sorted_ptr=I32), dict(E_P=256, BLOCK_S=32), 4, 1,
                    quick=True, no_spill=True))
    for slots, label in ((64, "decode BM=16"), (8192, "BM=32"), (65536, "prefill")):   # moe_tiles' regimes at E = 256
        out += _moe_cases(slots, label)
    out += _moe_cases(576, "decode B=64 + shared expert", shared=True)   # layers/moe: the shared expert as expert 256
    for group in (32, 16):   # 4-bit experts (ops/fp4/tiles.py): MXFP4, NVFP4
        for slots, label in ((64, "decode BM=16"), (65536, "prefill")):
            out += _moe_cases(slots, label, w4=group)
        # sm_90's decode with the tiles right of the dots, as every other target has them (tools/sass_loop compares)
        out += _moe_cases(64, "decode BM=16 right", w4=group, right=True)
        if group == 32:   # the words program for scale codes past 128
            out += _moe_cases(64, "decode BM=16 wide", w4=group, wide=True)
        out += _moe_cases(576, "decode B=64 + shared expert", shared=True, w4=group)   # a 4-bit shared expert as E
    out += _fp4_linear_cases()
    return out + _fp8_cases()


def _moe_cases(slots: int, label: str, shared: bool = False, w4: int = 0, right: bool = False,
               wide: bool = False) -> list[Case]:
    """The two bf16 expert GEMMs of a step of `slots` (token, expert) pairs over Kimi-Linear's 256
    experts (hidden 2304, width 1024), on each target as ops/moe/fused.moe_tiles launches them there;
    `shared`: with the shared expert run as expert 256 (decode); `w4`: 4-bit experts in groups of
    32 (MXFP4) or 16 (NVFP4), K steps of at least 32 as moe_experts_fused widens them (MXFP4 through
    tl.dot_scaled on sm_100 and gfx950; on sm_90's decode the decoded tiles left of the dots, decoded
    by the words program: ops/fp4/tiles.fp4_weights_left); `right`: sm_90's decode with the tiles on
    the right of the dots, decoded bitwise, as every other target has them; `wide`: the words
    program for MXFP4 scale codes past 128 (ops/fp4/word_decode.py), sm_90 only."""
    from kdaserve.ops.fp4.tiles import fp4_weights_left, scale_pair_pipelines
    from kdaserve.ops.moe.fused import _moe_down_kernel, _moe_gate_up_kernel, moe_tiles
    from kdaserve.ops.precision import native_fp4_dots

    def launch(t: str, which: str) -> dict:
        tiles = moe_tiles(slots, 256 + shared, 2304, 1024, False, t, four_bit=bool(w4), fp4_left=False if right else None)
        bn, bk, warps, stages = getattr(tiles, which)
        # MXFP4 through tl.dot_scaled where the target multiplies fp4 itself, as moe_experts_fused picks
        w4_opts = dict(W4_DOT=True, A_FORMAT="bf16") if w4 == 32 and native_fp4_dots(t) else {}
        bk = max(bk, 32) if w4 else bk
        if w4 and which == "gate_up" and not w4_opts:   # gate's and up's scales in one load where that pipelines them
            w4_opts["W4_PAIR"] = scale_pair_pipelines(bn, bk, w4, warps)
        if w4:   # each target's own choice (a per-target launch adds to sm_90's constants: say False too)
            left = not w4_opts.get("W4_DOT") and not right and fp4_weights_left(t, tiles.block_m)
            # left: bf16 x on an NVIDIA GPU, the words program (WIDE: MXFP4 scale codes past 128)
            w4_opts.update(W4_LEFT=left, W4_WORDS=left, W4_WIDE=left and wide)
        return {"consts": dict(BM=tiles.block_m, BN=bn, BK=bk, **w4_opts), "warps": warps,
                "stages": stages or (2 if t.startswith("gfx") else 3)}

    common = dict(FP8=False, BLOCK_ROWS=1, EVEN_K=True, HAS_SHARED=shared, W4=w4)
    not_on = tuple(t for t in TARGETS if t != "sm_90") if right or wide else ()
    W, WS = ("*u8", "*u8") if w4 else (BF, BF)
    name = f"moe {'mx' if w4 == 32 else 'nv' if w4 else ''}{'fp4 ' if w4 else ''}"
    return [
        Case(f"{name}gate_up {label}", _moe_gate_up_kernel,
             dict(x_ptr=BF, w_ptr=W, sorted_ptr=I32, experts_ptr=I32, h_ptr=BF, xs_ptr=BF, ws_ptr=WS, shared_w_ptr=W,
                  wd_ptr=F32, shared_ws_ptr=WS, shared_wd_ptr=F32),
             dict(TOPK=8 + shared, LIMIT=0.0, HAS_LIMIT=False, **common, **launch("sm_90", "gate_up")["consts"]),
             quick=slots == 64, precision={"PREC": "tc"}, no_spill=True, not_on=not_on,
             per_target={t: launch(t, "gate_up") for t in TARGETS}),
        Case(f"{name}down {label}", _moe_down_kernel,
             dict(h_ptr=BF, w_ptr=W, sorted_ptr=I32, experts_ptr=I32, weights_ptr=F32, y_ptr=BF, hs_ptr=BF, ws_ptr=WS,
                  shared_w_ptr=W, wd_ptr=F32, shared_ws_ptr=WS, shared_wd_ptr=F32),
             dict(**common, **launch("sm_90", "down")["consts"]), quick=slots == 64, precision={"PREC": "tc"},
             no_spill=True, not_on=not_on, per_target={t: launch(t, "down") for t in TARGETS}),
    ]


def _fp4_linear_cases() -> list[Case]:
    """The 4-bit linear layer (ops/fp4/linear.py) at each of its tile choices, MXFP4 and NVFP4 (MXFP4
    through tl.dot_scaled where the target multiplies fp4, as fp4_linear picks)."""
    from kdaserve.ops.fp4.linear import _fp4_linear_kernel, fp4_tiles
    from kdaserve.ops.precision import native_fp4_dots

    out = []
    for m in (1, 64, 4096):
        bm, bn, bk, warps = fp4_tiles(m)
        for group in (32, 16):
            dots = {t: {"consts": dict(W4_DOT=True, A_FORMAT="bf16")} for t in TARGETS if group == 32 and native_fp4_dots(t)}
            out.append(Case(f"fp4 linear BM={bm} group={group}", _fp4_linear_kernel,
                            dict(x_ptr=BF, w_ptr="*u8", s_ptr="*u8", d_ptr=F32, bias_ptr=BF, y_ptr=BF),
                            dict(GROUP=group, HAS_BIAS=False, EVEN_K=True, BM=bm, BN=bn, BK=bk), warps,
                            quick=m == 1, precision={"PREC": "tc"}, no_spill=True, per_target=dots))
    return out


def _fp8_cases() -> list[Case]:
    """Block-scaled FP8 (GLM-5.3-Flash's release, 128 x 128 blocks): the activation quantizer, the
    linear GEMM at its tile choices (ops/fp8/block_gemm.GEMM_CONFIGS) and the FP8 expert GEMMs. Only
    for targets with OCP FP8 dots (not gfx942, whose FP8 is the fnuz kind)."""
    from kdaserve.ops.fp8.block_gemm import GEMM_CONFIGS, _block_fp8_gemm_kernel
    from kdaserve.ops.fp8.quant import _quantize_group_kernel
    from kdaserve.ops.moe.fused import _moe_down_kernel, _moe_gate_up_kernel, fp8_tiles

    F8, no = "*fp8e4nv", ("gfx942",)
    out = [Case("fp8 quantize group=128", _quantize_group_kernel, dict(x_ptr=BF, q_ptr=F8, s_ptr=F32),
                dict(GROUP=128, FMAX=448.0, FLOOR=1e-10), 1, quick=True, no_spill=True, not_on=no)]
    for bm, bn, warps, stages in GEMM_CONFIGS.values():
        out.append(Case(f"fp8 gemm BM={bm} BN={bn}", _block_fp8_gemm_kernel,
                        dict(a_ptr=F8, as_ptr=F32, w_ptr=F8, ws_ptr=F32, bias_ptr=BF, c_ptr=BF),
                        dict(BLOCK_ROWS=128, HAS_BIAS=False, EVEN_K=True, BM=bm, BN=bn, BK=128), warps, stages,
                        quick=bm == 64 and bn == 64, no_spill=True, not_on=no))
    for bm in (16, 32, 64):   # moe_block_m's choices
        bn, warps = fp8_tiles(bm)
        out.append(Case(f"fp8 moe gate_up BM={bm}", _moe_gate_up_kernel,
                        dict(x_ptr=F8, w_ptr=F8, sorted_ptr=I32, experts_ptr=I32, h_ptr=BF, xs_ptr=F32, ws_ptr=F32),
                        dict(TOPK=8, LIMIT=10.0, HAS_LIMIT=True, BM=bm, BN=bn, BK=128, FP8=True, BLOCK_ROWS=128, EVEN_K=True),
                        warps, quick=bm == 16, precision={"PREC": "tc"}, no_spill=True, not_on=no))
        out.append(Case(f"fp8 moe down BM={bm}", _moe_down_kernel,
                        dict(h_ptr=F8, w_ptr=F8, sorted_ptr=I32, experts_ptr=I32, weights_ptr=F32, y_ptr=BF, hs_ptr=F32,
                             ws_ptr=F32),
                        dict(BM=bm, BN=bn, BK=128, FP8=True, BLOCK_ROWS=128, EVEN_K=True), warps, quick=bm == 16,
                        precision={"PREC": "tc"}, no_spill=True, not_on=no))
    return out


def all_cases(quick: bool = False, kernels: tuple[str, ...] = ()) -> list[Case]:
    """Every case, or one shape per kernel (`quick`); `kernels`: only names starting with one of these."""
    cases = _flash_cases() + _decode_cases() + _other_cases()
    return [c for c in cases if (c.quick or not quick) and (not kernels or c.name.startswith(kernels))]


def markdown_cell(res: Resources, target: str) -> str:
    """A cell of docs/portability.md's table: registers per thread (r) or VGPRs + AGPRs per lane (v),
    shared memory / LDS in KiB, spill stores (sp) or scratch (sc) in bytes where not zero."""
    unit, spill = ("r", "sp") if target.startswith("sm_") else ("v", "sc")
    cell = f"{res.registers} {unit}, {round(res.shared_bytes / 1024)} K"
    return cell + (f", {res.spill_bytes} B {spill}" if res.spill_bytes else "")


def markdown_table(cells: dict[str, dict[str, str]], targets: tuple[str, ...]) -> str:
    """Kernels x targets, in the order the cases ran (`--markdown`)."""
    lines = ["| kernel | " + " | ".join(targets) + " |", "|---|" + "---|" * len(targets)]
    lines += [f"| {name} | " + " | ".join(row.get(t, "-") for t in targets) + " |" for name, row in cells.items()]
    return "\n".join(lines)


def check(target: str, cases: list[Case], baseline: dict[str, int] | None = None,
          cells: dict[str, dict[str, str]] | None = None) -> tuple[list[str], dict[str, int]]:
    """(problems, spill bytes by case) for one target; `baseline`: sm_90's spills by case; `cells`:
    filled with each case's markdown_cell (or why there is none) by name and target."""
    problems, spills = [], {}
    cells = {} if cells is None else cells
    for c in cases:
        if target.startswith(c.not_on or ("\0",)):
            print(f"{target} {c.name}: not launched there", flush=True)
            cells.setdefault(c.name, {})[target] = "not launched"
            continue
        try:
            consts, warps, stages = c.launch(target)
            kernel = compile_for(c.kernel, c.types, consts, target, warps, stages)
            res = resources(kernel, target)
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
            print(f"{target} {c.name}: FAILED to compile: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            problems.append(f"{target} {c.name}: does not compile")
            cells.setdefault(c.name, {})[target] = "does not compile"
            continue
        spills[c.name] = res.spill_bytes
        cells.setdefault(c.name, {})[target] = markdown_cell(res, target)
        notes = []
        if res.shared_bytes > SHARED_LIMIT[target]:
            notes.append(f"SHARED {res.shared_bytes} > {SHARED_LIMIT[target]}")
        if res.wgmma_serialized:   # ptxas made every wgmma wait for the one before (ops/moe/fused.py: why and a cure)
            notes.append("WGMMA SERIALIZED")
        if res.spill_bytes and c.no_spill:
            notes.append("SPILLS")
        elif res.spill_bytes and target != "sm_90" and baseline is not None and not baseline.get(c.name):
            notes.append("SPILLS (the sm_90 build does not)")
        prec = {k: v for k, v in c.constexprs(target).items() if k in c.precision}
        print(f"{target} {c.name}: {res.report(target)} {occupancy(res, target, warps)}"
              f"{' ' + str(prec) if prec else ''}{' ' + ' '.join(notes) if notes else ''}", flush=True)
        problems += [f"{target} {c.name}: {n}" for n in notes]
    return problems, spills


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sm_90", help=f"one of {', '.join(TARGETS)}, a comma-separated list, or all")
    ap.add_argument("--quick", action="store_true", help="one serving shape per kernel")
    ap.add_argument("--kernels", default="", help="comma-separated name prefixes (e.g. mla,moe): only those kernels")
    ap.add_argument("--markdown", action="store_true",
                    help="also print the kernels x targets table of docs/portability.md, last")
    args = ap.parse_args(argv)
    if triton.knobs.runtime.interpret:
        sys.exit("run without TRITON_INTERPRET: this compiles for the GPU")
    targets = TARGETS if args.arch == "all" else tuple(args.arch.split(","))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown architecture {unknown}; expected {', '.join(TARGETS)} or all")
    cases = all_cases(args.quick, tuple(k for k in args.kernels.split(",") if k))
    problems, baseline, cells = [], None, {}
    if any(t != "sm_90" for t in targets):
        # sm_90 first: a spill elsewhere counts only where the sm_90 build has none.
        probs, baseline = check("sm_90", cases, cells=cells)
        problems += probs if "sm_90" in targets else []
    for t in targets:
        if t != "sm_90" or baseline is None:
            probs, _ = check(t, cases, baseline, cells)
            problems += probs
    if args.markdown:
        print(markdown_table(cells, tuple(t for t in TARGETS if t in targets)))
    if problems:
        print(f"{len(problems)} problems:\n  " + "\n  ".join(problems))
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
