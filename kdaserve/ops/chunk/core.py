"""The chunked KDA core after the conv: gate -> intra-chunk -> serial state pass -> output + norm.

Input is the post-conv y [T, 3P] (q|k|v, any row stride, columns contiguous), the gate logits g1,
the beta logits and the output-gate logits g2 as the layer produces them; l2norm, gate and beta
sigmoid happen inside the kernels. Final states go into the pool in place; the normalized output
goes into the caller's `out`. Intermediates live in per-call buffers in the workspace dtype (see
workspace_dtype; fp32 for the gate cumsum and the diagonal blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.ops.limits import CHUNK as CHUNK_LIMITS
from kdaserve.ops.chunk.gate import launch_gate_cumsum
from kdaserve.ops.chunk.intra import BC, launch_intra
from kdaserve.ops.chunk.output import launch_output_norm
from kdaserve.ops.chunk.state import launch_state_pass
from kdaserve.ops.chunk.tables import ChunkTables, build_chunk_tables
from kdaserve.ops.host_tables import host_offsets
from kdaserve.ops.types import KDAWeights

CHUNK = 64  # tokens per chunk (four 16-token sub-blocks, see intra.py)

INTRA_VARIANTS = ("blocked", "substitution")  # ChunkConfig.intra_inverse


def workspace_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """dtype of the conv output y and of every 16-bit intermediate (w, u, kg, qg, Aqk, h, v_new).

    fp16, not bf16, for bf16 inputs: the same bytes and the same tensor-core rate, 8x finer
    rounding (10 vs 7 mantissa bits). Measured through the interpreter with GPU-faithful rounding
    (docs/chunk-prefill.md): bf16 y + bf16 workspace gives ~4.4e-3 output / 5.0e-3 state relative
    RMS error at 256 tokens (the 5e-3 budget gone), fp16 gives 1.75e-3 / 6.8e-4 (the output's own
    bf16 rounding is 1.65e-3 of that). Range: every workspace value is a normalized key/query
    (<= 1), a decay-weighted one, an intra-chunk solve of those, or a value-sized quantity (v, u,
    v_new, the state); fp16's 65504 limit binds only if conv outputs exceed it.
    """
    return torch.float32 if input_dtype == torch.float32 else torch.float16


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (the CPU/interpreter contract is 1e-5); 16-bit inputs get
    # tf32 for the products whose operands are computed in fp32 (intra-chunk matrices, w, u).
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class ChunkConfig:
    """Launch shapes (benchmarks/bench_prefill.py --sweep times the alternatives).

    state_bv None picks by occupancy: narrow V-tiles give more programs when few (sequence, head)
    pairs run (one long prompt), wide tiles re-read w/kg less when the GPU is full anyway (the
    timings behind the rule: docs/perf-notes.md, chunk state pass)."""

    intra_warps: int = 8      # 8: no spill with the wide layout (4 spills)
    # The intra stage (intra.py): the diagonal 16x16 inverses by recursive blocking in registers
    # ("blocked", tf32 dots for 16-bit inputs) or by forward substitution in fp32 FMAs, a 15-step
    # chain of scratch loads ("substitution"); A and Aqk by row blocks against every
    # earlier column in one [16, K] x [K, 32-64] dot, A through an fp32 scratch [T, H, 64]
    # (intra_wide), or one [16, K] x [K, 16] dot per block pair, which all 8 warps repeat.
    # Default "blocked" + wide: the fastest variant timed for the bounded gate (docs/perf-notes.md).
    intra_inverse: str = "blocked"
    intra_wide: bool = True
    # Register cap per thread (ptxas spills the rest) so that more programs share an SM; None: none.
    intra_maxnreg: int | None = None
    # The inverse's dots at the products' precision (tf32 for 16-bit inputs) or always "ieee" fp32
    # (FMA loops on sm_90). fp32 inputs always get "ieee". docs/chunk-prefill.md argues tf32.
    # None: tf32 for "blocked", "ieee" for "substitution".
    intra_inverse_tf32: bool | None = None
    state_bv: int | None = None
    state_warps: int | None = None  # None: 4 up to BV = 32, 8 for BV = 64 (4 would spill there)
    # Software pipelining of the next chunk's w/u/kg loads. None: 3 for BV = 16 (a serial chain
    # waits on those loads), else 2 (a third stage costs occupancy there); docs/perf-notes.md.
    state_stages: int | None = None
    output_warps: int = 4

    def __post_init__(self):
        if self.intra_inverse not in INTRA_VARIANTS:
            raise ValueError(f"intra_inverse must be one of {INTRA_VARIANTS}, got {self.intra_inverse!r}")

    def bv(self, num_seqs: int, H: int, D: int) -> int:
        if self.state_bv is not None:
            return min(self.state_bv, D)
        if D <= 32:
            return D
        pairs = num_seqs * H
        if pairs <= 32:     # one or two long prompts on a narrow shard: D / 16 programs per pair
            return 16
        return 32 if pairs < 256 else 64

    def stages_for(self, bv: int) -> int:
        return self.state_stages if self.state_stages is not None else (3 if bv <= 16 else 2)

    def warps_for(self, bv: int) -> int:
        return self.state_warps if self.state_warps is not None else (8 if bv >= 64 else 4)


DEFAULT_CONFIG = ChunkConfig()


def chunk_tables(cu_seqlens_cpu: torch.Tensor, device: torch.device) -> ChunkTables:
    """The chunk tables of a step, built from the host copy of its cu_seqlens."""
    return build_chunk_tables(host_offsets(cu_seqlens_cpu), CHUNK, device)


class ChunkPlan:
    """One call's tables, workspace and the four stage launches (separable for benchmarking).

    Workspace per token-head at D = 128 and a 16-bit input: gcum 512 B (fp32), Aqk 128 B, A 256 B
    (fp32; its diagonal blocks only, 64 B, without intra_wide), w/u/kg/qg/v_new 5 x 256 B, chunk
    states 512 B: ~2.7 KB."""

    def __init__(self, y, g1, beta_logits, g2, weights: KDAWeights, recurrent_state, cu_seqlens, state_indices,
                 has_initial_state, out, cu_seqlens_cpu, config: ChunkConfig = DEFAULT_CONFIG,
                 tables: ChunkTables | None = None):
        T = y.shape[0]
        H, D = weights.num_heads, weights.head_dim
        dev, dt = y.device, y.dtype
        self.args = (y, g1, beta_logits, g2, weights, recurrent_state, cu_seqlens, state_indices, has_initial_state, out)
        self.config = config
        self.tables = tables if tables is not None else chunk_tables(cu_seqlens_cpu, dev)
        self.prec = _dot_precision(dt)
        self.gcum = torch.empty(T, H, D, device=dev, dtype=torch.float32)
        self.Aqk = torch.empty(T, H, CHUNK, device=dev, dtype=dt)
        # fp32 inputs on a GPU keep the per-pair intra: their "ieee" wide dots with the unbounded
        # gate's exact diagonal compile to ~28 KB of spills per thread (ptxas sm_90; per pair 1.5 KB).
        self.intra_wide = config.intra_wide and not (self.prec == "ieee" and dev.type == "cuda")
        # fp32 scratch of the intra kernel: all of A (wide) or its diagonal blocks (read back by
        # "substitution").
        self.akk_scratch = torch.empty(T, H, CHUNK if self.intra_wide else BC, device=dev, dtype=torch.float32)
        # One allocation split in five (each a contiguous [T, H, D]): one allocator call, not five.
        self.w, self.u, self.kg, self.qg, self.v_new = torch.empty(5, T, H, D, device=dev, dtype=dt).unbind(0)
        self.h_states = torch.empty(self.tables.num_chunks, H, D, D, device=dev, dtype=dt)

    def gate(self) -> None:
        y, g1, _, _, weights, _, _, state_indices, _, _ = self.args
        if self.tables.num_chunks:
            launch_gate_cumsum(g1, weights, self.gcum, self.tables, state_indices, CHUNK)

    def intra(self) -> None:
        y, _, beta_logits, _, weights, _, _, state_indices, _, _ = self.args
        if self.tables.num_chunks:
            c = self.config
            tf32 = c.intra_inverse_tf32 if c.intra_inverse_tf32 is not None else c.intra_inverse != "substitution"
            inv_prec = self.prec if tf32 else "ieee"
            args = (y, beta_logits, self.gcum, self.tables, state_indices, self.Aqk, self.akk_scratch, self.w, self.u,
                    self.kg, self.qg)
            launch_intra(*args, exact_diag=weights.lower_bound is None, precision=self.prec, BT=CHUNK,
                         num_warps=c.intra_warps, blocked_inverse=c.intra_inverse != "substitution",
                         inverse_precision=inv_prec, maxnreg=c.intra_maxnreg, wide=self.intra_wide)

    def state(self) -> None:
        # Runs even without chunks: a 0-token sequence still stores its (initial or zero) state.
        _, _, _, _, weights, pool, cu_seqlens, state_indices, has_initial_state, _ = self.args
        c = self.config
        bv = c.bv(state_indices.shape[0], weights.num_heads, weights.head_dim)
        launch_state_pass(self.w, self.u, self.kg, self.gcum, self.v_new, self.h_states, pool, cu_seqlens, self.tables,
                          state_indices, has_initial_state, BT=CHUNK, BV=bv, precision=self.prec,
                          num_warps=c.warps_for(bv), num_stages=c.stages_for(bv))

    def output(self) -> None:
        _, _, _, g2, weights, _, _, state_indices, _, out = self.args
        if self.tables.num_chunks:
            launch_output_norm(self.qg, self.h_states, self.Aqk, self.v_new, g2, weights.norm_weight, weights.norm_eps,
                               out, self.tables, state_indices, BT=CHUNK, precision=self.prec,
                               num_warps=self.config.output_warps)

    def run(self) -> None:
        self.gate()
        self.intra()
        self.state()
        self.output()


def check_core_inputs(y: torch.Tensor, weights: KDAWeights) -> None:
    D = weights.head_dim
    CHUNK_LIMITS.check(head_dim=D, lower_bound=weights.lower_bound, input_dtype=y.dtype)
    if not (weights.dt_bias.is_contiguous() and weights.norm_weight.is_contiguous()):
        raise ValueError("dt_bias and norm_weight must be contiguous")


def kda_chunk_core(
    y: torch.Tensor,
    g1: torch.Tensor,
    beta_logits: torch.Tensor,
    g2: torch.Tensor,
    weights: KDAWeights,
    recurrent_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_cpu: torch.Tensor,
    config: ChunkConfig = DEFAULT_CONFIG,
    tables: ChunkTables | None = None,
) -> None:
    """The core after the conv. y is normally in the workspace dtype already (the glue asks the
    conv for it); a bf16 y (a caller's own conv) keeps bf16 for the workspace: less precise.
    `tables`: the step's chunk tables (built once for all layers); None builds them here."""
    check_core_inputs(y, weights)
    if y.shape[0] == 0 and state_indices.shape[0] == 0:
        return
    ChunkPlan(y, g1, beta_logits, g2, weights, recurrent_state, cu_seqlens, state_indices, has_initial_state, out,
              cu_seqlens_cpu, config, tables).run()
