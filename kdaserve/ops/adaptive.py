"""The `adaptive` decode backend: `fused` for small steps, `chain` for large ones, chosen per call.

Why: on the H200 (docs/perf-notes.md, "Decode, default launch rule re-timed") the single launch
wins while a step is latency-bound — up to 1.56x at one sequence — and ties the chain at about
512 head-steps (sequences x heads x tokens per sequence: 32 heads x 16 sequences, 16 x 32, 64 x 8,
for fp32 and bf16 states alike). Above that the chain is 7-12% faster with an fp32 state and up to
23% with a bf16 state: the fused kernel's V-split programs each redo their head's conv, l2norm and
k.q, which the chain does once, and that costs more than the two launches it saves once state
traffic dominates. A speculative verify of 4 tokens crosses over at the same head-step count
(fused 11.0 vs chain 13.3 us at 1 x 32 heads x 4 tokens; 40.5 vs 39.0 us at 8 sequences).

The choice reads shapes only (host integers), so no device value is read, a captured CUDA graph
holds exactly one of the two paths, and replay pays nothing for the choice. The threshold is the
H200's; other GPUs move it (bench_decode.py prints both columns to re-measure it).
"""

from __future__ import annotations

import torch

from kdaserve.ops.chain import kda_decode_chain
from kdaserve.ops.fused import kda_decode_fused
from kdaserve.ops.types import KDAWeights

FUSED_MAX_HEAD_STEPS = 512


def uses_fused(num_sequences: int, num_heads: int, tokens_per_sequence: int = 1) -> bool:
    """True when `adaptive` runs the step with the single-launch kernel."""
    return num_sequences * num_heads * tokens_per_sequence <= FUSED_MAX_HEAD_STEPS


def kda_decode_adaptive(
    qkv: torch.Tensor,
    g1: torch.Tensor,
    beta_logits: torch.Tensor,
    g2: torch.Tensor,
    weights: KDAWeights,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor,
    *,
    conv_layout: str = "SD",
    spec_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
) -> None:
    """The contract of kda_decode_reference; both paths check their inputs themselves."""
    tokens = 1 if spec_state_indices is None else spec_state_indices.shape[-1]
    decode = kda_decode_fused if uses_fused(state_indices.shape[0], weights.num_heads, tokens) else kda_decode_chain
    decode(qkv, g1, beta_logits, g2, weights, conv_state, recurrent_state, state_indices, out,
           conv_layout=conv_layout, spec_state_indices=spec_state_indices, num_accepted_tokens=num_accepted_tokens)
