"""Entry point of the flash prefill: checks, the work plan, workspaces and the launches.

Launch sequence (all on the current stream, no device->host sync, sizes from host values only):
  plan      one launch: chunk and segment tables from cu_seqlens (plan.py)
  prepare   K1 over (chunk, head): conv, l2norm, gate, beta, WY factors -> workspace (prepare.py)
  then either
  recurrence  K2 over (sequence, head): state in registers, fused gated RMSNorm -> out, pool, conv state
  or, when sequences x heads are too few to fill the GPU (sequence parallelism):
  map pass    K2 over (segment, head, {values, identity}, V-slice) -> o_loc, q~, (B, M)
  scan        over (sequence, head, V-slice): start state of every segment, final state -> pool
  correct     over (segment, head, chunk group): o = o_loc + S_start q~, gated RMSNorm -> out
"""

from __future__ import annotations

import functools

import torch
import triton

from kdaserve.ops.checks import check_common, check_prefill
from kdaserve.ops.flash.config import CONFIG
from kdaserve.ops.flash.correct import flash_correct_kernel
from kdaserve.ops.flash.plan import build_plan, choose_segment_len
from kdaserve.ops.flash.prepare import flash_prepare_kernel
from kdaserve.ops.flash.recurrence import flash_recurrence_kernel
from kdaserve.ops.flash.scan import flash_scan_kernel
from kdaserve.ops.types import KDAWeights, conv_state_rows

HEAD_DIMS = (16, 32, 64, 128)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_flash_inputs(qkv, weights: KDAWeights, recurrent_state, g1, g2, out, D: int) -> None:
    """What flash needs beyond the common contract (metadata only, no sync)."""
    _expect(D in HEAD_DIMS, f"flash prefill supports head sizes {HEAD_DIMS}, got D = {D}")
    _expect(qkv.dtype in INPUT_DTYPES, f"flash prefill takes bf16, fp16 or fp32 inputs, got {qkv.dtype}")
    _expect(recurrent_state.stride(3) == 1, f"recurrent_state must have K contiguous (stride(3) == 1), got strides {recurrent_state.stride()}")
    lb = weights.lower_bound
    _expect(lb is None or -5.0 <= lb < 0.0, f"lower_bound must lie in [-5, 0) or be None (unbounded gate), got {lb}")
    for name, t in (("g1", g1), ("g2", g2), ("out", out)):
        try:
            t.view(t.shape[0], weights.num_heads, D)
        except RuntimeError as e:
            raise ValueError(f"{name} must be viewable as [T, H, D] (strided rows are fine), got strides {t.stride()}") from e


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: plan as for an H200, so CPU tests exercise the same choices


def dot_precisions(device: torch.device, ws_dtype: torch.dtype) -> tuple[str, str]:
    """(tensor-core precision, exact precision) for fp32 dot operands.

    fp32 workspaces (fp32 inputs, the interpreter's tests) use IEEE fp32 throughout. On NVIDIA the
    bulk fp32 dots of K1 use tf32 (10-bit mantissa like the fp16 workspace they feed) and the small
    precision-critical ones (the chunk inverse, the scan of segment maps) tf32x3, which is
    fp32-accurate. ROCm's Triton has no tf32x3: IEEE there."""
    if ws_dtype == torch.float32 or device.type != "cuda" or torch.version.hip:
        return "ieee", "ieee"
    return "tf32", "tf32x3"


def resolve_segment_len(segment_len: int | None, T: int, N: int, H: int, D: int, chunk: int, cu_seqlens_cpu, device) -> int | None:
    """None: automatic; 0: never segment; > 0: force segments of that many tokens (tests)."""
    if segment_len is None:
        return choose_segment_len(T, N, H, D, chunk, cu_seqlens_cpu, _num_sms(device), CONFIG)
    if segment_len == 0:
        return None
    _expect(segment_len > 0, f"segment_len must be None, 0 or positive, got {segment_len}")
    return segment_len


def kda_prefill_flash(
    qkv: torch.Tensor,
    g1: torch.Tensor,
    beta_logits: torch.Tensor,
    g2: torch.Tensor,
    weights: KDAWeights,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor,
    *,
    conv_layout: str = "SD",
    cu_seqlens_cpu: torch.Tensor | None = None,
    segment_len: int | None = None,
) -> None:
    """Varlen KDA prefill (conv -> l2norm/gate/beta -> delta rule -> gated RMSNorm), the contract of
    `kda_prefill_reference`. `segment_len` (flash only) overrides the sequence-parallel choice:
    None = automatic, 0 = off, n > 0 = segments of n tokens (rounded up to the chunk size)."""
    T, H, D = check_common(qkv, g1, beta_logits, g2, weights, conv_state, recurrent_state, out, conv_layout)
    N = check_prefill(T, cu_seqlens, state_indices, has_initial_state)
    check_flash_inputs(qkv, weights, recurrent_state, g1, g2, out, D)
    if N == 0:
        return
    cfg = CONFIG
    C = cfg.chunk
    _expect(C in (16, 32), f"flash chunk size must be 16 or 32, got {C}")
    dev = qkv.device
    ws_dtype = torch.float32 if qkv.dtype == torch.float32 else torch.float16
    prec_tc, prec_exact = dot_precisions(dev, ws_dtype)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    seg_len = resolve_segment_len(segment_len, T, N, H, D, C, cu_seqlens_cpu, dev)
    plan = build_plan(cu, T, N, C, seg_len, cu_seqlens_cpu)

    rows = conv_state_rows(conv_state, conv_layout)
    L = rows.shape[1]
    cw = weights.conv_weight
    a_log, dt_bias, nw = weights.A_log.contiguous(), weights.dt_bias.contiguous(), weights.norm_weight.contiguous()
    g1v, g2v, outv = g1.view(T, H, D), g2.view(T, H, D), out.view(T, H, D)
    st = recurrent_state

    nc = plan.n_chunk_ids
    ws = torch.empty(4, nc, H, C, D, dtype=ws_dtype, device=dev)
    w_ws, u_ws, qg_ws, kd_ws = ws.unbind(0)
    aqk_ws = torch.empty(nc, H, C, C, dtype=ws_dtype, device=dev)
    gam_ws = torch.empty(nc, H, D, dtype=torch.float32, device=dev)

    if nc > 0:
        flash_prepare_kernel[(nc * H,)](
            qkv, qkv.stride(0),
            g1v, *g1v.stride(),
            beta_logits, *beta_logits.stride(),
            cw, *cw.stride(),
            rows, *rows.stride(),
            a_log, dt_bias,
            cu, state_indices, has_initial_state,
            plan.chunk_seq, plan.chunk_tok,
            w_ws, u_ws, qg_ws, kd_ws, aqk_ws, gam_ws,
            float(weights.lower_bound if weights.lower_bound is not None else 0.0), D ** -0.5, L,
            H=H, D=D, C=C, LOG2C=C.bit_length() - 1, W=weights.conv_width,
            BOUNDED=weights.lower_bound is not None, PREC_TC=prec_tc, PREC_EXACT=prec_exact,
            num_warps=cfg.prepare_warps,
        )

    common = dict(H=H, D=D, C=C, L_PAD=triton.next_power_of_2(L), PREC=prec_tc)
    recur_args = (
        w_ws, u_ws, qg_ws, kd_ws, aqk_ws, gam_ws,
        st, st.stride(0), st.stride(1), st.stride(2),
        outv, *outv.stride(),
        g2v, *g2v.stride(),
        nw, float(weights.norm_eps),
    )
    tail_args = (
        cu, state_indices, has_initial_state,
        plan.seg_seq, plan.seg_tok, plan.seg_end, plan.seg_chunk,
        qkv, qkv.stride(0), rows, *rows.stride(), L,
    )
    if not plan.segmented:
        flash_recurrence_kernel[(plan.n_seg_ids * H,)](
            *recur_args, ws, ws, *tail_args, 0,
            BV=D, SEGMENTED=False, num_warps=cfg.recur_warps, num_stages=cfg.recur_stages, **common,
        )
        return

    ns = plan.n_seg_ids
    oq = torch.empty(2, T, H, D, dtype=torch.float32, device=dev)
    bm = torch.empty(ns, 2, H, D, D, dtype=torch.float32, device=dev)
    start = torch.empty(ns, H, D, D, dtype=torch.float32, device=dev)
    bv = min(cfg.seg_block_v, D)
    flash_recurrence_kernel[(ns * H * 2 * (D // bv),)](
        *recur_args, oq, bm, *tail_args, T * H * D,
        BV=bv, SEGMENTED=True, num_warps=cfg.seg_warps, num_stages=cfg.seg_stages, **common,
    )
    sbv = min(cfg.scan_block_v, D)
    flash_scan_kernel[(N * H * (D // sbv),)](
        bm, start, st, st.stride(0), st.stride(1), st.stride(2), state_indices, plan.seq_seg0,
        H=H, D=D, BV=sbv, PREC=prec_exact, num_warps=cfg.scan_warps, num_stages=cfg.scan_stages,
    )
    cpg = cfg.correct_chunks
    longest = int((cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).max()) if cu_seqlens_cpu is not None else T
    ng = max(triton.cdiv(min(plan.segment_len, longest), cpg * C), 1)
    flash_correct_kernel[(ns * H * ng,)](
        oq, start, outv, *outv.stride(), g2v, *g2v.stride(), nw, float(weights.norm_eps),
        cu, state_indices, plan.seg_seq, plan.seg_tok, plan.seg_end, T * H * D,
        H=H, D=D, C=C, CPG=cpg, NG=ng, DOT_DTYPE=_tl_dtype(ws_dtype), PREC=prec_tc,
        num_warps=cfg.correct_warps,
    )


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16}[dtype]
