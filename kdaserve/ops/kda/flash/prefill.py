"""Entry point of the flash prefill: checks, the work plan, workspaces and the launches.

Launch sequence (all on the current stream, no device->host sync, sizes from host values only):
  plan      one launch: chunk and segment tables from cu_seqlens (plan.py), once per step
            (flash_step_plan; the engine builds it before the layers and passes it to each)
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
from dataclasses import dataclass

import torch
import triton

from kdaserve.ops.compile_ahead import compiles_ahead, compiling_ahead
from kdaserve.ops.kda.checks import check_prefill_step
from kdaserve.ops.kda.flash.config import FlashConfig, config_for
from kdaserve.ops.kda.flash.correct import flash_correct_kernel
from kdaserve.ops.kda.flash.plan import FlashPlan, build_plan, choose_segment_len, seq_lens
from kdaserve.ops.kda.flash.prepare import flash_prepare_kernel
from kdaserve.ops.kda.flash.recurrence import flash_recurrence_kernel
from kdaserve.ops.kda.flash.scan import flash_scan_kernel
from kdaserve.ops.kda.host_tables import host_offsets
from kdaserve.ops.kda.limits import FLASH
from kdaserve.ops.kda.types import KDACache, KDAInputs, KDAWeights, PrefillSeqs, conv_state_rows
from kdaserve.ops.precision import dot_precision, num_sms
from kdaserve.ops.triton_math import tl_dtype


@dataclass(frozen=True, slots=True)
class FlashStepPlan:
    """What a prefill step needs before its layers run: the work tables (built on the device by one
    launch), the longest sequence, the chunk size and the config they were made for. Built once
    per step (`flash_step_plan`) and shared by every layer of the step."""

    plan: FlashPlan | None   # None: a step without sequences
    longest: int
    chunk: int
    num_heads: int
    head_dim: int
    num_tokens: int
    config: FlashConfig
    offsets: tuple[int, ...] | None   # the host cu_seqlens it was built from, when known


def chunk_size_for(bounded_gate: bool, config: FlashConfig) -> int:
    """The unbounded gate's own chunk size (FlashConfig.unbounded_chunk; flash_step_plan takes
    unbounded_segmented_chunk instead for a step it segments, docs/flash-prefill.md)."""
    C = config.chunk if bounded_gate else config.unbounded_chunk
    if C not in (16, 32):
        raise ValueError(f"flash chunk size must be 16 or 32, got {C}")
    return C


def chunk_sizes_for(bounded_gate: bool, config: FlashConfig) -> tuple[int, ...]:
    """Every chunk size a step plan may take for this gate."""
    if bounded_gate:
        return (chunk_size_for(True, config),)
    return (config.unbounded_chunk, config.unbounded_segmented_chunk)


def unbounded_intra_for(config: FlashConfig, input_dtype: torch.dtype | None) -> str:
    """The unbounded gate's intra-chunk factors for these inputs (None: 16-bit): the configured
    ones, except that fp32 inputs (fp32 workspaces) take the exact nested ones for the clamped
    ones, since the clamp's error (below e^-clamp) is under 16-bit rounding, not fp32's."""
    return "nested" if config.unbounded_intra == "clamped" and input_dtype == torch.float32 else config.unbounded_intra


def segmented_chunk_for(bounded_gate: bool, config: FlashConfig, input_dtype: torch.dtype | None) -> int:
    """The chunk size of a step flash segments automatically: the unbounded gate's clamped K1 takes
    unbounded_segmented_chunk there (few long sequences: the recurrence's chain of chunk steps is
    the bound, so longer chunks, whose K1 joins two anchored halves, pay for their dearer K1 there,
    and only there); otherwise the gate's own chunk size."""
    if not bounded_gate and unbounded_intra_for(config, input_dtype) == "clamped":
        return config.unbounded_segmented_chunk
    return chunk_size_for(bounded_gate, config)


def flash_step_plan(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None, num_tokens: int, num_heads: int,
                    head_dim: int, bounded_gate: bool, *, config: FlashConfig | None = None,
                    segment_len: int | None = None, input_dtype: torch.dtype | None = None) -> FlashStepPlan:
    """The plan of one step of `num_tokens` tokens for layers of `num_heads` x `head_dim` with this
    gate kind. `segment_len`: None = automatic, 0 = never segment, n > 0 = segments of n tokens.
    Without the host copy of cu_seqlens the sizes are upper bounds (every sequence counted as long
    as the step) and the tables are built on the device all the same (no sync). `config`: None is
    the device's default (config.config_for). State checkpoints do not change it: the kernels
    write them wherever they fall (recurrence.py). `input_dtype`: the layers' q|k|v dtype (None:
    16-bit); fp32 inputs keep the unbounded gate's 16-token chunks in segmented steps, since their
    exact nested K1 at 32 costs more registers than its halved recurrence saves (and more VGPRs
    than gfx942 has)."""
    config = config if config is not None else config_for(cu_seqlens.device)
    C = chunk_size_for(bounded_gate, config)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    N = cu.shape[0] - 1
    if N == 0:
        return FlashStepPlan(None, 0, C, num_heads, head_dim, num_tokens, config, (0,))
    seg_len = resolve_segment_len(segment_len, num_tokens, N, num_heads, head_dim, C, cu_seqlens_cpu, cu.device, config)
    if segment_len is None and seg_len and segmented_chunk_for(bounded_gate, config, input_dtype) != C:
        C = segmented_chunk_for(bounded_gate, config, input_dtype)
        seg_len = resolve_segment_len(None, num_tokens, N, num_heads, head_dim, C, cu_seqlens_cpu, cu.device, config)
    plan = build_plan(cu, num_tokens, N, C, seg_len, cu_seqlens_cpu)
    offsets = host_offsets(cu_seqlens_cpu) if cu_seqlens_cpu is not None else None
    longest = max(seq_lens(offsets)) if offsets is not None else num_tokens
    return FlashStepPlan(plan, longest, C, num_heads, head_dim, num_tokens, config, offsets)


def check_flash_inputs(qkv, weights: KDAWeights, recurrent_state, forget_logits, output_gate_logits, out,
                       D: int) -> tuple[torch.Tensor, ...]:
    """What flash needs beyond the common contract (metadata only, no sync); returns the
    [T, H, D] views of forget_logits, output_gate_logits and out the kernels take."""
    FLASH.check(head_dim=D, lower_bound=weights.lower_bound, input_dtype=qkv.dtype, state_dtype=recurrent_state.dtype)
    if recurrent_state.stride(3) != 1:
        raise ValueError(f"recurrent_state must have K contiguous (stride(3) == 1), got strides {recurrent_state.stride()}")
    views = []
    for name, t in (("forget_logits", forget_logits), ("output_gate_logits", output_gate_logits), ("out", out)):
        try:
            views.append(t.view(t.shape[0], weights.num_heads, D))
        except RuntimeError as e:
            raise ValueError(f"{name} must be viewable as [T, H, D] (strided rows are fine), got strides {t.stride()}") from e
    return tuple(views)


def dot_precisions(device: torch.device, ws_dtype: torch.dtype) -> tuple[str, str]:
    """(tensor-core precision, exact precision) for fp32 dot operands (kdaserve/ops/precision.py).

    fp32 workspaces (fp32 inputs, the interpreter's tests) use IEEE fp32 throughout. Otherwise the
    fp32 dots of K1 take the target's tensor-core precision (tf32 on NVIDIA: a 10-bit mantissa like
    the fp16 workspace they feed) and the scan of segment maps its exact one (tf32x3 on NVIDIA),
    since its start states feed every later output."""
    if ws_dtype == torch.float32:
        return "ieee", "ieee"
    p = dot_precision(device)
    return p.tensor_core, p.exact


def use_fast_math(device: torch.device) -> bool:
    """Single-instruction PTX exp/rcp/tanh (fastmath.py): NVIDIA sm_75+ (tanh.approx), never in
    the interpreter."""
    if device.type != "cuda" or torch.version.hip or triton.knobs.runtime.interpret:
        return False
    return _has_ptx_fast_math(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _has_ptx_fast_math(device_index: int) -> bool:
    # Cached: every prefill step of every layer asks, and the host time of a step matters.
    return torch.cuda.get_device_capability(device_index) >= (7, 5)


def resolve_segment_len(segment_len: int | None, T: int, N: int, H: int, D: int, chunk: int, cu_seqlens_cpu, device,
                        config: FlashConfig) -> int | None:
    """None: automatic; 0: never segment; > 0: force segments of that many tokens (tests)."""
    if segment_len is None:
        return choose_segment_len(T, N, H, D, chunk, cu_seqlens_cpu, num_sms(device), config)
    if segment_len == 0:
        return None
    if segment_len < 0:
        raise ValueError(f"segment_len must be None, 0 or positive, got {segment_len}")
    return segment_len


def kda_prefill_flash(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: PrefillSeqs, out: torch.Tensor,
    *,
    segment_len: int | None = None,
    config: FlashConfig | None = None,
    step_plan: FlashStepPlan | None = None,
) -> None:
    """Varlen KDA prefill (conv -> l2norm/gate/beta -> delta rule -> gated RMSNorm), the contract of
    `kda_prefill_reference`. `segment_len` (flash only) overrides the sequence-parallel choice:
    None = automatic, 0 = off, n > 0 = segments of n tokens (rounded up to the chunk size).
    `step_plan`: the step's `flash_step_plan`, built once for all layers (it carries its config and
    segment choice); None builds one for this call from `config` and `segment_len`."""
    FlashPrefill(inputs, weights, cache, seqs, out, segment_len=segment_len, config=config, step_plan=step_plan).run()


class FlashPrefill:
    """One prefill step: checks, plan and workspaces at construction, then one method per launch
    (so tools/tune_flash.py can time each stage alone). `run()` is the whole step."""

    def __init__(self, inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: PrefillSeqs, out: torch.Tensor,
                 *, segment_len: int | None = None, config: FlashConfig | None = None,
                 step_plan: FlashStepPlan | None = None):
        qkv, forget_logits, beta_logits, output_gate_logits = inputs
        conv_state, recurrent_state, conv_layout = cache
        cu_seqlens, state_indices, has_initial_state, cu_seqlens_cpu = seqs
        T, H, D, N = check_prefill_step(inputs, weights, cache, seqs, out)
        self.forget_v, self.out_gate_v, self.outv = check_flash_inputs(qkv, weights, recurrent_state, forget_logits,
                                                                       output_gate_logits, out, D)
        self.T, self.H, self.D, self.N = T, H, D, N
        ck = seqs.checkpoints
        ck_offsets = ck.offsets_cpu if ck is not None and any(ck.offsets_cpu) else None
        if step_plan is None:
            step_plan = flash_step_plan(cu_seqlens, cu_seqlens_cpu, T, H, D, weights.lower_bound is not None,
                                        config=config, segment_len=segment_len, input_dtype=qkv.dtype)
        elif (step_plan.num_tokens, step_plan.num_heads, step_plan.head_dim) != (T, H, D) or (
                step_plan.chunk not in chunk_sizes_for(weights.lower_bound is not None, step_plan.config)) or (
                cu_seqlens_cpu is not None and step_plan.offsets is not None
                and step_plan.offsets != host_offsets(cu_seqlens_cpu)):
            raise ValueError(f"the flash step plan was built for another step ({step_plan.num_tokens} tokens x "
                             f"{step_plan.num_heads} heads x {step_plan.head_dim}, chunk {step_plan.chunk}, lengths "
                             f"{step_plan.offsets}), not this call's {T} x {H} x {D} with the "
                             f"{'bounded' if weights.lower_bound is not None else 'unbounded'} gate; build it for this step")
        self.cfg, self.C = step_plan.config, step_plan.chunk
        self.call = (inputs, weights, cache, seqs, out)   # for the sibling variants compiled ahead
        if N == 0:
            return
        dev = qkv.device
        self.ws_dtype = torch.float32 if qkv.dtype == torch.float32 else torch.float16
        self.prec_tc, self.prec_exact = dot_precisions(dev, self.ws_dtype)
        self.fast = use_fast_math(dev)
        self.cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        self.qkv, self.beta_logits, self.weights, self.st = qkv, beta_logits, weights, recurrent_state
        self.state_indices, self.has_initial_state = state_indices, has_initial_state
        self.rows = conv_state_rows(conv_state, conv_layout)
        self.nw = weights.norm_weight.contiguous()
        self.plan, self.longest = step_plan.plan, step_plan.longest
        C = self.C
        self.ck = self._check_checkpoints(ck, ck_offsets, step_plan, N)
        self.checkpoint_maps = None

        nc = self.plan.n_chunk_ids
        self.ws = torch.empty(4, nc, H, C, D, dtype=self.ws_dtype, device=dev)  # W, U~, Qg, Kd
        self.ws4 = self.ws.unbind(0)
        self.aqk_ws = torch.empty(nc, H, C, C, dtype=self.ws_dtype, device=dev)
        self.chunk_decay_ws = torch.empty(nc, H, D, dtype=torch.float32, device=dev)
        if self.plan.segmented:
            ns = self.plan.n_seg_ids
            # o_loc (the output from a zero start) and q~ per token (fp16: 2^-11)
            self.local_out_and_q = torch.empty(2, T, H, D, dtype=self.ws_dtype, device=dev)
            # each segment's affine map S_end = S_start B + M (B, M)
            self.segment_maps_ws = torch.empty(ns, 2, H, D, D, dtype=torch.float32, device=dev)
            self.segment_starts = torch.empty(ns, H, D, D, dtype=torch.float32, device=dev)
            # a checkpoint inside a later segment: that segment's (B, M) up to it, for the scan
            # (fp32 like the segment maps; every table column has room, few sequences segment)
            self.checkpoint_maps = None if self.ck is None else torch.empty(
                N * self.ck[2], 2, H, D, D, dtype=torch.float32, device=dev)

    def _check_checkpoints(self, ck, ck_offsets, step_plan: FlashStepPlan, N: int):
        """(offsets, slots, width) for the kernels, or None: no checkpoints this step."""
        if ck_offsets is None:
            return None
        C, L = self.C, self.rows.shape[1]
        if len(ck_offsets) != N or tuple(ck.offsets.shape) != tuple(ck.slots.shape) or ck.offsets.shape[0] != N:
            raise ValueError(f"state checkpoints must be [N = {N}, K] offsets and slots with {N} host rows, got "
                             f"{tuple(ck.offsets.shape)}, {tuple(ck.slots.shape)} and {len(ck_offsets)} rows")
        if L > C:
            raise ValueError(f"flash writes a checkpoint's conv window from the step's tokens only: it needs conv rows "
                             f"(width - 1 + speculative tokens = {L}) of at most its chunk ({C})")
        lens = seq_lens(step_plan.offsets) if step_plan.offsets is not None else None
        for n, offs in enumerate(ck_offsets):
            bad = [o for o in offs if o <= 0 or o % C or (lens is not None and o >= lens[n])]
            if bad:
                raise ValueError(f"sequence {n}: state checkpoint offsets must be interior (0 < offset < "
                                 f"{lens[n] if lens else 'its new tokens'}) multiples of the chunk ({C}); got {bad}")
            if any(a >= b for a, b in zip(offs, offs[1:])):   # the kernel runs the chunks in pieces between them
                raise ValueError(f"sequence {n}: state checkpoint offsets must increase; got {list(offs)}")
        off = ck.offsets if ck.offsets.dtype == torch.int32 else ck.offsets.to(torch.int32)
        slots = ck.slots if ck.slots.dtype == torch.int32 else ck.slots.to(torch.int32)
        return off.contiguous(), slots.contiguous(), off.shape[1]

    def output_groups(self) -> int:
        """Chunk groups per segment in the segment output pass (its grid's axis y)."""
        return max(-(-min(self.plan.segment_len, self.longest) // (self.cfg.correct_chunks * self.C)), 1)

    @compiles_ahead   # at warm-up, its 2-4 kernels compile in parallel (ops/compile_ahead.py)
    def run(self) -> None:
        if self.N == 0:
            return
        if self.plan.segmented and self.output_groups() > _MAX_GRID_Y:
            # CUDA's limit on grid axis y; only a forced segment of > 8M tokens gets here. Checked
            # before any launch, so nothing (state or conv pool) is written.
            cap = _MAX_GRID_Y * self.cfg.correct_chunks * self.C
            raise ValueError(
                f"flash prefill: segments of up to {min(self.plan.segment_len, self.longest)} tokens need "
                f"{self.output_groups()} chunk groups in the correction pass, above the grid limit {_MAX_GRID_Y}; "
                f"pass cu_seqlens_cpu (so the longest sequence is known) or a segment_len of at most {cap} tokens")
        self.prepare()
        if not self.plan.segmented:
            self.recurrence()
        else:
            self.segment_maps()
            self.scan()
            self.segment_output()
        if compiling_ahead():
            self._compile_sibling()

    def _compile_sibling(self) -> None:
        """In a compile-ahead pass (nothing launches): also the kernels of the path this step did
        not take, segmented or not (with the unbounded gate also the other chunk size), so that a
        layer's first prefill at warm-up compiles all its variants at once instead of two rounds
        at two steps (perf-notes, twenty-second session). Compiled for its first sequence alone:
        the kernels' arguments specialize the same (strides, pointer alignment, multiples of 16),
        and the workspaces stay those of one sequence. Needs the host copy of cu_seqlens; without
        it, or with checkpoints (their offsets belong to this step's chunk size), nothing more."""
        if self.call is None:   # a sibling itself
            return
        inputs, weights, cache, seqs, out = self.call
        if seqs.cu_seqlens_cpu is None or self._nck():
            return
        n0 = int(seqs.cu_seqlens_cpu[1]) - int(seqs.cu_seqlens_cpu[0])
        if n0 < 1:
            return
        bounded = weights.lower_bound is not None
        segmented = not self.plan.segmented
        C = segmented_chunk_for(bounded, self.cfg, self.qkv.dtype) if segmented else chunk_size_for(bounded, self.cfg)
        first = slice(int(seqs.cu_seqlens_cpu[0]), int(seqs.cu_seqlens_cpu[0]) + n0)
        cu = (seqs.cu_seqlens[:2] - seqs.cu_seqlens[0]).to(torch.int32)
        cu_cpu = seqs.cu_seqlens_cpu[:2] - seqs.cu_seqlens_cpu[0]
        one = PrefillSeqs(cu, seqs.state_indices[:1], seqs.has_initial_state[:1], cu_cpu)
        seg_len = -(-n0 // C) * C if segmented else None   # one segment: the segmented kernels
        plan = FlashStepPlan(build_plan(cu, n0, 1, C, seg_len, cu_cpu), n0, C, self.H, self.D, n0, self.cfg,
                             host_offsets(cu_cpu))
        sibling = FlashPrefill(inputs.rows(first), weights, cache, one, out[first], step_plan=plan)
        sibling.call = None
        sibling.run()

    def prepare(self) -> None:
        """Chunks inside their sequences' new tokens, then the first chunk(s) of each sequence
        (conv history) in a second launch (prepare.py says why)."""
        nc, H = self.plan.n_chunk_ids, self.H
        if nc == 0:
            return
        nfirst = -(-(self.weights.conv_width - 1) // self.C)
        self._prepare((nc * H,), False, nfirst)
        if nfirst:   # a conv of width 1 has no history
            self._prepare((self.N * H * nfirst,), True, nfirst)

    def _prepare(self, grid, first: bool, nfirst: int) -> None:
        D, C, w, plan = self.D, self.C, self.weights, self.plan
        lb = w.lower_bound
        prefetch = self.cfg.prepare_prefetch and self.fast
        flash_prepare_kernel[grid](
            self.qkv, self.qkv.stride(0),
            self.forget_v, *self.forget_v.stride(),
            self.beta_logits, *self.beta_logits.stride(),
            w.conv_weight, *w.conv_weight.stride(),
            self.rows, *self.rows.stride(),
            w.A_log.contiguous(), w.dt_bias.contiguous(),
            self.cu, self.state_indices, self.has_initial_state,
            plan.chunk_seq, plan.chunk_tok, plan.seq_seg0, plan.seg_chunk,
            *self.ws4, self.aqk_ws, self.chunk_decay_ws,
            float(lb if lb is not None else 0.0), D ** -0.5, self.rows.shape[1], float(self.cfg.unbounded_decay_clamp),
            self.T, H=self.H, D=D, C=C, LOG2C=C.bit_length() - 1, W=w.conv_width,
            BOUNDED=lb is not None, PREC_TC=self.prec_tc, FAST=self.fast, FIRST=first, NFIRST=max(nfirst, 1),
            NESTED=lb is None and unbounded_intra_for(self.cfg, self.qkv.dtype) == "nested",
            INV_DT=tl_dtype(self.ws_dtype if self.cfg.prepare_half_dots else torch.float32),
            PREFETCH=prefetch, GATE_DT=tl_dtype(w.gate_dtype), num_warps=self.cfg.prepare_warps, **self._prepare_maxnreg(),
        )

    def _prepare_maxnreg(self) -> dict:
        """K1's register cap for this gate (both launches), where there is one: NVIDIA's compiler
        (AMD's and the interpreter refuse the option)."""
        cfg = self.cfg
        n = cfg.prepare_maxnreg if self.weights.lower_bound is not None else cfg.unbounded_prepare_maxnreg
        native = not triton.knobs.runtime.interpret and not torch.version.hip
        return {"maxnreg": n} if n and native else {}

    def _recurrence(self, grid, local_out_and_q, maps, q_off, bv, segmented, warps, stages) -> None:
        st, plan, L = self.st, self.plan, self.rows.shape[1]
        flash_recurrence_kernel[grid](
            *self.ws4, self.aqk_ws, self.chunk_decay_ws,
            st, st.stride(0), st.stride(1), st.stride(2),
            self.outv, *self.outv.stride(),
            self.out_gate_v, *self.out_gate_v.stride(),
            self.nw, float(self.weights.norm_eps),
            local_out_and_q, maps,
            self.cu, self.state_indices, self.has_initial_state,
            plan.seg_seq, plan.seg_tok, plan.seg_end, plan.seg_chunk,
            self.qkv, self.qkv.stride(0), self.rows, *self.rows.stride(), L, q_off,
            *self._ck_args(),
            H=self.H, D=self.D, C=self.C, BV=bv, SEGMENTED=segmented, L_PAD=triton.next_power_of_2(L),
            PREC=self.prec_tc, FAST=self.fast, NCK=self._nck(), CK_PIECES=self.cfg.checkpoint_pieces,
            num_warps=warps, num_stages=stages,
        )

    def _ck_args(self) -> tuple:
        # Without checkpoints the kernels compile the code out (NCK = 0); any tables stand in.
        if self.ck is None:
            return self.cu, self.cu, self.chunk_decay_ws
        maps = self.checkpoint_maps
        return (*self.ck[:2], maps if maps is not None else self.chunk_decay_ws)

    def _nck(self) -> int:
        return self.ck[2] if self.ck is not None else 0

    def recurrence(self) -> None:
        """Unsegmented: one program per (sequence, head), fused norm, states in place."""
        cfg = self.cfg
        self._recurrence((self.plan.n_seg_ids * self.H,), self.ws, self.ws, 0, self.D, False,
                         cfg.recur_warps, cfg.recur_stages)

    def segment_maps(self) -> None:
        cfg, D = self.cfg, self.D
        bv = min(cfg.seg_block_v, D)
        grid = (self.plan.n_seg_ids * self.H * 2 * (D // bv),)
        self._recurrence(grid, self.local_out_and_q, self.segment_maps_ws, self.T * self.H * D, bv, True, cfg.seg_warps,
                         cfg.seg_stages)

    def scan(self) -> None:
        cfg, D, H, st = self.cfg, self.D, self.H, self.st
        sbv = min(cfg.scan_block_v, D)
        flash_scan_kernel[(self.N * H * (D // sbv),)](
            self.segment_maps_ws, self.segment_starts, st, st.stride(0), st.stride(1), st.stride(2), self.state_indices,
            self.plan.seq_seg0,
            *self._ck_args(), self.plan.segment_len,
            H=H, D=D, BV=sbv, PREC=self.prec_exact, NCK=self._nck(), num_warps=cfg.scan_warps, num_stages=cfg.scan_stages,
        )

    def segment_output(self) -> None:
        """o = o_loc + S_start q~ per segment, then the gated RMSNorm (correct.py)."""
        cfg, plan, H, D, C = self.cfg, self.plan, self.H, self.D, self.C
        cpg = cfg.correct_chunks
        ng = self.output_groups()
        flash_correct_kernel[(plan.n_seg_ids * H, ng)](
            self.local_out_and_q, self.segment_starts, self.outv, *self.outv.stride(), self.out_gate_v,
            *self.out_gate_v.stride(), self.nw,
            float(self.weights.norm_eps), self.cu, self.state_indices, plan.seg_seq, plan.seg_tok, plan.seg_end,
            self.T * H * D,
            H=H, D=D, C=C, CPG=cpg, DOT_DTYPE=tl_dtype(self.ws_dtype), PREC=self.prec_tc, FAST=self.fast,
            num_warps=cfg.correct_warps,
        )


_MAX_GRID_Y = 65535



