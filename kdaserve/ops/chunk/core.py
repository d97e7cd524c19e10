"""The chunked KDA core after the conv: gate -> intra-chunk -> serial state pass -> output + norm.

Input is the post-conv y [T, 3P] (q|k|v, any row stride, columns contiguous), the gate logits g1,
the beta logits and the output-gate logits g2 as the layer produces them; l2norm, gate and beta
sigmoid happen inside the kernels. Final states go into the pool in place; the normalized output
goes into the caller's `out`. Intermediates live in per-call buffers in the input dtype (fp32 for
the gate cumsum).
"""

from __future__ import annotations

import torch

from kdaserve.ops.chunk.gate import launch_gate_cumsum
from kdaserve.ops.chunk.intra import BC, launch_intra
from kdaserve.ops.chunk.output import launch_output_norm
from kdaserve.ops.chunk.state import launch_state_pass
from kdaserve.ops.chunk.tables import ChunkTableCache, ChunkTables
from kdaserve.ops.types import KDAWeights

CHUNK = 64  # tokens per chunk (four 16-token sub-blocks, see intra.py)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_tables = ChunkTableCache()


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


def state_pass_tile(num_seqs: int, H: int, D: int) -> int:
    """V-tile of the serial pass: narrow tiles give more programs when few (sequence, head)
    pairs run (one long prompt), wide tiles re-read w/kg less when the GPU is full anyway."""
    if D <= 32:
        return D
    return 32 if num_seqs * H < 256 else 64


def chunk_tables(cu_seqlens_cpu: torch.Tensor, device: torch.device) -> ChunkTables:
    return _tables.get(cu_seqlens_cpu, CHUNK, device)


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
) -> None:
    T = y.shape[0]
    H, D = weights.num_heads, weights.head_dim
    if y.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"chunk prefill takes bf16, fp16 or fp32 inputs, got {y.dtype}")
    # y is normally already in the workspace dtype (the glue asks the conv for it); a bf16 y
    # (a caller's own conv) keeps bf16 for the workspace, which costs precision, not correctness.
    if D < 16 or D & (D - 1):
        raise ValueError(f"chunk prefill needs a power-of-two head size >= 16, got D = {D}")
    if weights.lower_bound is not None and not -5.0 <= weights.lower_bound < 0.0:
        raise ValueError(f"the bounded gate needs lower_bound in [-5, 0) (its anchoring relies on it), got {weights.lower_bound}")
    if not (weights.dt_bias.is_contiguous() and weights.norm_weight.is_contiguous()):
        raise ValueError("dt_bias and norm_weight must be contiguous")
    if T == 0 and state_indices.shape[0] == 0:
        return
    dev, dt = y.device, y.dtype
    tables = chunk_tables(cu_seqlens_cpu, dev)
    prec = _dot_precision(dt)

    gcum = torch.empty(T, H, D, device=dev, dtype=torch.float32)
    Aqk = torch.empty(T, H, CHUNK, device=dev, dtype=dt)
    akk_diag = torch.empty(T, H, BC, device=dev, dtype=torch.float32)
    w, u, kg, qg, v_new = (torch.empty(T, H, D, device=dev, dtype=dt) for _ in range(5))
    h_states = torch.empty(tables.num_chunks, H, D, D, device=dev, dtype=dt)

    if tables.num_chunks:
        launch_gate_cumsum(g1, weights, gcum, tables, state_indices, CHUNK)
        launch_intra(y, beta_logits, gcum, tables, state_indices, Aqk, akk_diag, w, u, kg, qg,
                     exact_diag=weights.lower_bound is None, precision=prec, BT=CHUNK)
    # Runs even without chunks: a 0-token sequence still stores its (initial or zero) state.
    launch_state_pass(w, u, kg, gcum, v_new, h_states, recurrent_state, cu_seqlens, tables, state_indices,
                      has_initial_state, BT=CHUNK, BV=state_pass_tile(state_indices.shape[0], H, D), precision=prec)
    if tables.num_chunks:
        launch_output_norm(qg, h_states, Aqk, v_new, g2, weights.norm_weight, weights.norm_eps, out, tables,
                           state_indices, BT=CHUNK, precision=prec)
