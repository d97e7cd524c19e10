"""The `adaptive` decode backend: `fused` or `chain`, whichever the H200 measured faster for the step.

History and evidence (docs/perf-notes.md): with only the split launch shapes, the single launch won
while a step was latency-bound (up to 1.56x at one sequence) and tied the chain at about 512
head-steps (sequences x heads x tokens per sequence); above, the chain was 7-12% faster (fp32
state) and up to 23% (bf16), because each V-split program redid its head's conv and meeting cost.
The `stream` launch shape of `fused` (one program per head, state tiles through a cp.async
pipeline; default from 256 heads) removed that: on the H200 at 32 heads fused is now the faster of
the two at every measured size of a plain decode (N = 1, 8, 64, 128, 256, 512; fp32 state 1.04-1.54x
chain, bf16 1.14-1.67x; "Decode, stream shape"), so plain decode always takes `fused`.
Speculative verify has no stream shape (its state tile stays in registers across the tokens), so
it keeps the old crossover: fused up to 512 head-steps (11.0 vs chain 13.3 us at 1 x 32 heads x 4
tokens; 40.5 vs 39.0 us at 8 sequences).

The choice reads shapes only (host integers), so no device value is read, a captured CUDA graph
holds exactly one of the two paths, and replay pays nothing for the choice. The thresholds are the
H200's; other GPUs move them (bench_decode.py prints both columns to re-measure).
"""

from __future__ import annotations

import torch

from kdaserve.ops.chain import kda_decode_chain
from kdaserve.ops.fused import kda_decode_fused
from kdaserve.ops.types import DecodeSeqs, KDACache, KDAInputs, KDAWeights

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
