"""`chunk`: the chunk-64 multi-kernel Triton prefill backend. Design and numerics: docs/chunk-prefill.md.

    conv (kdaserve.ops.conv, varlen, conv pool in place)
    -> gate + chunk cumsum (gate.py) -> intra-chunk matrices, inverse, w/u (intra.py)
    -> serial state pass on the pool in place (state.py) -> output + gated RMSNorm (output.py)

Same calling convention as kdaserve.ops.reference.kda_prefill_reference (minus chunk_size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.ops.checks import check_prefill_step
from kdaserve.ops import interpreter_compat
from kdaserve.ops.chunk.core import CHUNK, DEFAULT_CONFIG, ChunkConfig, chunk_tables, kda_chunk_core, workspace_dtype
from kdaserve.ops.limits import CHUNK as CHUNK_LIMITS
from kdaserve.ops.chunk.tables import ChunkTables
from kdaserve.ops.conv import ConvTables, causal_conv_varlen_fwd, conv_step_tables
from kdaserve.ops.host_tables import host_offsets
from kdaserve.ops.types import KDACache, KDAInputs, KDAWeights, PrefillSeqs

interpreter_compat.install()


@dataclass(frozen=True, slots=True)
class ChunkStepPlan:
    """What a prefill step needs before its layers run: the conv's token blocks and the chunk
    tables. Built once per step (`chunk_step_plan`) and shared by every layer."""

    conv: ConvTables
    chunks: ChunkTables


def chunk_step_plan(cu_seqlens_cpu: torch.Tensor, device: torch.device) -> ChunkStepPlan:
    return ChunkStepPlan(conv_step_tables(host_offsets(cu_seqlens_cpu), device), chunk_tables(cu_seqlens_cpu, device))


def kda_prefill_chunk(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: PrefillSeqs, out: torch.Tensor,
    *,
    config: ChunkConfig = DEFAULT_CONFIG,
    step_plan: ChunkStepPlan | None = None,
) -> None:
    """Varlen prefill (mixed steps included): conv, chunked KDA core, gated RMSNorm into `out`.

    Pass `cu_seqlens_cpu` (the host copy the engine already has): chunk tables are built from it
    without a device->host sync. Without it a device `cu_seqlens` is copied to the host (a sync:
    fine for tests and tools, not for serving). Sequences whose slot is <= 0 are skipped entirely
    (their output rows are not written, no state is read or written). `step_plan`: the step's
    tables from `chunk_step_plan`, built once for all layers; None builds them for this call.
    """
    qkv, g1, beta_logits, g2 = inputs
    conv_state, recurrent_state, conv_layout = cache
    cu_seqlens, state_indices, has_initial_state, cu_seqlens_cpu = seqs
    if cu_seqlens_cpu is None:  # a device->host sync: callers in the hot path pass the host copy
        cu_seqlens_cpu = cu_seqlens if cu_seqlens.device.type == "cpu" else cu_seqlens.cpu()
    T, H, D, _ = check_prefill_step(inputs, weights, cache, seqs, out)
    CHUNK_LIMITS.check(head_dim=D, lower_bound=weights.lower_bound, input_dtype=qkv.dtype,
                       state_dtype=recurrent_state.dtype)
    # The conv writes its output straight in the workspace dtype (fp16 for bf16 inputs: core.py).
    y = torch.empty(qkv.shape, dtype=workspace_dtype(qkv.dtype), device=qkv.device)
    plan = step_plan if step_plan is not None else chunk_step_plan(cu_seqlens_cpu, qkv.device)
    causal_conv_varlen_fwd(qkv, weights.conv_weight, conv_state, cu_seqlens, state_indices, has_initial_state,
                           conv_layout, cu_seqlens_cpu=cu_seqlens_cpu, out=y, tables=plan.conv)
    kda_chunk_core(y, g1, beta_logits, g2, weights, recurrent_state, cu_seqlens, state_indices, has_initial_state, out,
                   cu_seqlens_cpu=cu_seqlens_cpu, config=config, tables=plan.chunks)


__all__ = ["CHUNK", "ChunkConfig", "ChunkStepPlan", "chunk_step_plan", "kda_chunk_core", "kda_prefill_chunk"]
