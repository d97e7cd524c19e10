"""The `adaptive` decode backend: `fused` or `chain`, whichever is faster for the step's shape.

The rule (the evidence: docs/perf-notes.md, the decode sections): a plain decode always takes
`fused` (with its `stream` shape it is the faster of the two at every measured size); a
speculative verify, which has no stream shape (its state tile stays in registers across the
tokens), takes `fused` up to FUSED_MAX_VERIFY_HEAD_STEPS head-steps (sequences x heads x tokens
per sequence) and `chain` above, where the V-split programs' repeated conv and meeting cost more
than the launches they save.

The choice reads shapes only (host integers), so no device value is read, a captured CUDA graph
holds exactly one of the two paths, and replay pays nothing for the choice. The thresholds are the
H200's; other GPUs move them (bench_decode.py prints both columns to re-measure).
"""

from __future__ import annotations

import torch

from kdaserve.ops.kda.chain import kda_decode_chain
from kdaserve.ops.kda.fused import kda_decode_fused
from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs, KDAWeights

FUSED_MAX_HEAD_STEPS: int | None = None  # plain decode (one token per sequence); None: always fused
FUSED_MAX_VERIFY_HEAD_STEPS = 512        # speculative verify (several tokens per sequence)


def uses_fused(num_sequences: int, num_heads: int, tokens_per_sequence: int = 1, verify: bool | None = None) -> bool:
    """True when `adaptive` runs the step with the single-launch kernel. `verify` (default: more
    than one token per sequence) picks the speculative-verify limit; a verify with no drafts has one
    token per sequence and is still a verify."""
    if verify is None:
        verify = tokens_per_sequence > 1
    limit = FUSED_MAX_VERIFY_HEAD_STEPS if verify else FUSED_MAX_HEAD_STEPS
    return limit is None or num_sequences * num_heads * tokens_per_sequence <= limit


def kda_decode_adaptive(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: DecodeSeqs, out: torch.Tensor,
) -> None:
    """The contract of kda_decode_reference; both paths check their inputs themselves."""
    state_indices, spec_state_indices, _ = seqs
    tokens = 1 if spec_state_indices is None else spec_state_indices.shape[-1]
    use = uses_fused(state_indices.shape[0], weights.num_heads, tokens, verify=spec_state_indices is not None)
    decode = kda_decode_fused if use else kda_decode_chain
    decode(inputs, weights, cache, seqs, out)
