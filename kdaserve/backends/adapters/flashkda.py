"""`flashkda` prefill backend: Moonshot AI's FlashKDA (`flash_kda.fwd`, CUTLASS, SM90+) behind our
calling convention.

FlashKDA takes raw bf16 q/k/v, gate logits and beta logits (l2norm, the bounded gate and the beta
sigmoid are fused), head size 128, and dense [N, H, V, K] initial/final states (fp32 or bf16,
the same dtype). So: our Triton conv on the paged conv pool, states gathered from and scattered
to the recurrent pool (zeros without history; slots <= 0 untouched), our Triton gated norm.
"""

from __future__ import annotations

import torch

from kdaserve.backends.adapters.state_io import gather_states, scatter_states
from kdaserve.ops.kda.checks import check_prefill_step
from kdaserve.ops.kda.types import KDACache, KDAInputs, KDAWeights, PrefillSeqs


def kda_prefill_flashkda(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: PrefillSeqs, out: torch.Tensor, *, step_plan=None,
) -> None:
    qkv, forget_logits, beta_logits, output_gate_logits = inputs
    conv_state, recurrent_state, conv_layout = cache
    cu_seqlens, state_indices, has_initial_state, cu_seqlens_cpu = seqs
    import flash_kda

    from kdaserve.ops.kda.conv import causal_conv_varlen_fwd
    from kdaserve.ops.norm import gated_rms_norm_fwd

    T, H, D, _ = check_prefill_step(inputs, weights, cache, seqs, out)
    if weights.lower_bound is None:
        raise ValueError("flashkda computes the bounded gate only (lower_bound in [-5, 0)); this layer's gate is unbounded")
    if T == 0:
        return
    y = causal_conv_varlen_fwd(qkv, weights.conv_weight, conv_state, cu_seqlens, state_indices, has_initial_state,
                               conv_layout, cu_seqlens_cpu=cu_seqlens_cpu, tables=step_plan)
    q, k, v = (t.contiguous() for t in y.view(1, T, 3, H, D).unbind(2))
    h0 = gather_states(recurrent_state, state_indices, keep=has_initial_state).contiguous()
    ht = torch.empty_like(h0)
    o = torch.empty(1, T, H, D, dtype=q.dtype, device=q.device)
    flash_kda.fwd(
        q, k, v, forget_logits.reshape(1, T, H, D).contiguous(), beta_logits.reshape(1, T, H).contiguous(), D**-0.5, o,
        weights.A_log.float().contiguous(), weights.dt_bias.float().reshape(H, D).contiguous(), float(weights.lower_bound),
        initial_state=h0, final_state=ht, cu_seqlens=cu_seqlens.long(),
    )
    scatter_states(recurrent_state, state_indices, ht, state_indices > 0)
    gated_rms_norm_fwd(o.view(T, H, D), output_gate_logits, weights.norm_weight, weights.norm_eps, out)
