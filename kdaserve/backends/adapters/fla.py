"""`fla` backends: flash-linear-attention 0.6.0's KDA kernels behind our calling convention.

What runs where (why):
- conv: our Triton conv (kdaserve.ops.kda.conv). FLA's causal_conv1d keeps a dense [N, D, W] window per
  sequence and cannot read or update a paged conv pool (SD or DS, W-1+S rows) in place.
- prefill core: `fla.ops.kda.chunk_kda` with the gate, l2norm and beta sigmoid in the kernel and a
  V-first state. It has no paged state: initial states are gathered from the pool (fp32, zeros
  without history) and the final states scattered back.
- decode core: `fused_recurrent_kda_fwd`, which does take a paged pool (and per-token slots for a
  speculative verify), but has no padding guard: a row of slot 0 would write the null slot. So it
  runs on a gathered copy of the batch's states, scattered back for real rows only.
- gated norm: FLA's `rms_norm_gated(activation="sigmoid")`.
Conv outputs are kept in the input dtype, as FLA's own layers do.

FLA 0.6.0 silently dispatches chunk_kda to FlashKDA when `flash_kda` is installed. `fla` means
FLA's Triton kernels (FlashKDA is the `flashkda` backend), so FLA_FLASH_KDA defaults to 0 here.
"""

from __future__ import annotations

import os

import torch

from kdaserve.backends.adapters.state_io import gather_states, scatter_states
from kdaserve.ops.kda.checks import check_decode_step, check_prefill_step
from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs, KDAWeights, PrefillSeqs

os.environ.setdefault("FLA_FLASH_KDA", "0")


def _fla():
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return chunk_kda, fused_recurrent_kda_fwd, rms_norm_gated


def _conv():
    from kdaserve.ops.kda.conv import causal_conv_update_fwd, causal_conv_varlen_fwd

    return causal_conv_varlen_fwd, causal_conv_update_fwd


def _gate_args(weights: KDAWeights) -> dict:
    """Gate, l2norm and beta sigmoid in the kernel; V-first [V, K] states like our pool."""
    return dict(
        A_log=weights.A_log, dt_bias=weights.dt_bias.reshape(-1), use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=weights.lower_bound, safe_gate=weights.lower_bound is not None,
        state_v_first=True,
    )


def kda_prefill_fla(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: PrefillSeqs, out: torch.Tensor, *, step_plan=None,
) -> None:
    qkv, forget_logits, beta_logits, output_gate_logits = inputs
    conv_state, recurrent_state, conv_layout = cache
    cu_seqlens, state_indices, has_initial_state, cu_seqlens_cpu = seqs
    T, H, D, _ = check_prefill_step(inputs, weights, cache, seqs, out)
    if T == 0:
        return
    chunk_kda, _, rms_norm_gated = _fla()
    conv_varlen, _ = _conv()
    cu_cpu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()).long()
    y = conv_varlen(qkv, weights.conv_weight, conv_state, cu_seqlens, state_indices, has_initial_state, conv_layout,
                    cu_seqlens_cpu=cu_cpu, tables=step_plan)
    q, k, v = y.view(1, T, 3, H, D).unbind(2)
    h0 = gather_states(recurrent_state, state_indices, keep=has_initial_state, dtype=torch.float32)
    o, ht = chunk_kda(
        q=q, k=k, v=v, g=forget_logits.reshape(1, T, H, D), beta=beta_logits.reshape(1, T, H), scale=D**-0.5, initial_state=h0,
        output_final_state=True, cu_seqlens=cu_seqlens.long(), cu_seqlens_cpu=cu_cpu, **_gate_args(weights),
    )
    scatter_states(recurrent_state, state_indices, ht, state_indices > 0)
    y = rms_norm_gated(o.reshape(T * H, D), output_gate_logits.reshape(T * H, D), weights.norm_weight, None, activation="sigmoid",
                       eps=weights.norm_eps)
    out.view(T, H, D).copy_(y.view(T, H, D))  # rows of slots <= 0 are unspecified for prefill


def kda_decode_fla(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: DecodeSeqs, out: torch.Tensor,
) -> None:
    qkv, forget_logits, beta_logits, output_gate_logits = inputs
    conv_state, recurrent_state, conv_layout = cache
    state_indices, spec_state_indices, num_accepted_tokens = seqs
    T, H, D, N, m = check_decode_step(inputs, weights, cache, seqs, out)
    if N == 0:
        return
    _, fused_recurrent, rms_norm_gated = _fla()
    _, conv_update = _conv()
    y = conv_update(qkv, weights.conv_weight, conv_state, state_indices, num_accepted_tokens, conv_layout)
    q, k, v = (t.contiguous() for t in y.view(N, m, 3, H, D).unbind(2))
    if spec_state_indices is None:
        slots = state_indices.view(N, 1)
        accepted = None
    else:
        slots = spec_state_indices
        # Rows of padding may carry any count: keep the kernel's slot lookup inside its row.
        accepted = num_accepted_tokens.clamp(1, m).to(torch.int32)
    real_row = slots[:, 0] > 0
    scratch = gather_states(recurrent_state, slots)  # [N*(S+1) or N, H, V, K]
    scratch_idx = torch.arange(slots.numel(), dtype=torch.int32, device=qkv.device).view(slots.shape)
    o, _ = fused_recurrent(
        q=q, k=k, v=v, g=forget_logits.reshape(N, m, H, D).contiguous(), beta=beta_logits.reshape(N, m, H).contiguous(),
        initial_state=scratch, scale=D**-0.5, inplace_final_state=True,
        ssm_state_indices=scratch_idx if spec_state_indices is not None else scratch_idx.view(N),
        num_accepted_tokens=accepted, **_gate_args(weights),
    )
    scatter_states(recurrent_state, slots, scratch, (real_row.view(N, 1) & (slots > 0)).reshape(-1))
    y = rms_norm_gated(o.reshape(T * H, D), output_gate_logits.reshape(T * H, D), weights.norm_weight, None, activation="sigmoid",
                       eps=weights.norm_eps).view(T, H, D)
    rows_real = real_row.view(N, 1).expand(N, m).reshape(T, 1, 1)
    o_view = out.view(T, H, D)
    o_view.copy_(torch.where(rows_real, y.to(out.dtype), o_view))  # padding rows keep what they held
