"""The `chain` decode backend: conv update -> recurrence -> gated RMSNorm, three Triton launches.

Same contract as `kda_decode_reference` (plain decode and speculative verify). Design (why):
- Three simple kernels, each at its own best grid (channels for the conv, (sequence, head,
  V-tile) for the recurrence, rows for the norm): the baseline the single-launch `fused` backend
  must beat, and the fallback where it does not apply.
- Intermediates (conv output, pre-norm o) are fp32 workspaces: ~130 KB per token written and
  read back, ~3% of the fp32 state traffic (4 MiB per token at 32 heads; ~6% for a bf16 state),
  and keeping them in fp32 spends none of the bf16 error budget between launches.
- No host reads of device values and only shape-derived launch parameters: capturable by CUDA
  graphs (the workspaces come from the graph's private pool when captured).
"""

from __future__ import annotations

import torch

from kdaserve.ops.kda.checks import check_decode_step
from kdaserve.ops.kda.conv import causal_conv_update_fwd
from kdaserve.ops.kda.recurrent import kda_recurrent_fwd
from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs, KDAWeights
from kdaserve.ops.norm import gated_rms_norm_fwd


def kda_decode_chain(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: DecodeSeqs, out: torch.Tensor,
) -> None:
    qkv, forget_logits, beta_logits, output_gate_logits = inputs
    conv_state, recurrent_state, conv_layout = cache
    state_indices, spec_state_indices, num_accepted_tokens = seqs
    T, H, D, N, m = check_decode_step(inputs, weights, cache, seqs, out)
    if N == 0:
        return
    y = torch.empty(qkv.shape, dtype=torch.float32, device=qkv.device)
    causal_conv_update_fwd(qkv, weights.conv_weight, conv_state, state_indices, num_accepted_tokens, conv_layout, out=y)
    o = torch.empty(T, H, D, dtype=torch.float32, device=qkv.device)
    kda_recurrent_fwd(
        y, forget_logits, beta_logits, recurrent_state, weights, o,
        state_indices=state_indices, spec_state_indices=spec_state_indices, num_accepted_tokens=num_accepted_tokens,
    )
    row_index = state_indices if spec_state_indices is None else spec_state_indices[:, 0]
    gated_rms_norm_fwd(o, output_gate_logits, weights.norm_weight, weights.norm_eps, out,
                       row_state_indices=row_index, tokens_per_index=m)
