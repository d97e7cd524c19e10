"""`aiter` backends: AMD AITER's KDA kernels (Gluon, gfx950) behind our calling convention.

Entry points used (AITER's Triton attention package):
- prefill `aiter.ops.triton.attention.chunk_kda.chunk_kda(q, k, v, g, beta, A_log, dt_bias,
  lower_bound, cu_seqlens, chunk_indices, chunk_offsets, scale, out, initial_state,
  output_final_state)`: raw bf16 inputs (l2norm, bounded gate, beta sigmoid fused), head 128,
  fp32 V-first states. Its chunk tables are built here on the host from `cu_seqlens_cpu` (AITER's
  own helper reads them back from the device). States are gathered / scattered (zeros without
  history, slots <= 0 untouched) rather than paged, so slot 0 is never written.
- decode `aiter.ops.triton.attention.kda.fused_recurrent_kda(...)` in place on the fp32 pool with
  `ssm_state_indices` (per-token slots and `num_accepted_tokens` when verifying) and
  `pad_slot_guard=True` (slots <= 0 skipped), our Triton conv before it.
The gated norm is ours (Triton) in both phases. Untested here (no ROCm machine): resolution and
errors are tested on the CPU, the glue against a torch stand-in of these entry points.
"""

from __future__ import annotations

import inspect

import torch

from kdaserve.backends.adapters.state_io import gather_states, scatter_states
from kdaserve.ops.kda.checks import check_decode_step, check_prefill_step
from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs, KDAWeights, PrefillSeqs

CHUNK = 64  # AITER's KDA prefill chunk size


def _require_params(fn, names: tuple[str, ...], what: str) -> None:
    params = inspect.signature(fn).parameters
    missing = [n for n in names if n not in params]
    if missing:
        raise RuntimeError(f"the installed AITER's {what} lacks parameters {missing}: it predates the API this adapter uses")


def chunk_tables(cu_seqlens_cpu: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk_indices [NT, 2] int32 = (sequence, chunk within it), chunk_offsets [N+1] int64), on the host."""
    cu = cu_seqlens_cpu.long()
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    chunk = torch.arange(seq.numel()) - offsets[seq]
    return torch.stack([seq, chunk], 1).int().to(device), offsets.to(device)


def kda_prefill_aiter(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: PrefillSeqs, out: torch.Tensor, *, step_plan=None,
) -> None:
    qkv, forget_logits, beta_logits, output_gate_logits = inputs
    conv_state, recurrent_state, conv_layout = cache
    cu_seqlens, state_indices, has_initial_state, cu_seqlens_cpu = seqs
    from aiter.ops.triton.attention.chunk_kda import chunk_kda

    from kdaserve.ops.kda.conv import causal_conv_varlen_fwd
    from kdaserve.ops.norm import gated_rms_norm_fwd

    _require_params(chunk_kda, ("chunk_indices", "chunk_offsets", "initial_state", "output_final_state", "out"), "chunk_kda")
    T, H, D, _ = check_prefill_step(inputs, weights, cache, seqs, out)
    if weights.lower_bound is None:
        raise ValueError("aiter prefill computes the bounded gate only; this layer's gate is unbounded")
    if T == 0:
        return
    cu_cpu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
    y = causal_conv_varlen_fwd(qkv, weights.conv_weight, conv_state, cu_seqlens, state_indices, has_initial_state,
                               conv_layout, cu_seqlens_cpu=cu_cpu, tables=step_plan)
    q, k, v = y.view(1, T, 3, H, D).unbind(2)  # dense in [H, D], token stride 3P: what AITER reads
    chunk_indices, chunk_offsets = chunk_tables(cu_cpu, qkv.device)
    h0 = gather_states(recurrent_state, state_indices, keep=has_initial_state, dtype=torch.float32).contiguous()
    o = torch.empty(1, T, H, D, dtype=q.dtype, device=q.device)
    _, ht = chunk_kda(
        q, k, v, forget_logits.reshape(1, T, H, D), beta_logits.reshape(1, T, H), weights.A_log.float().contiguous(),
        weights.dt_bias.float().reshape(-1).contiguous(), float(weights.lower_bound), cu_seqlens.long().contiguous(),
        chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, scale=D**-0.5, out=o, initial_state=h0,
        output_final_state=True,
    )
    scatter_states(recurrent_state, state_indices, ht, state_indices > 0)
    gated_rms_norm_fwd(o.view(T, H, D), output_gate_logits, weights.norm_weight, weights.norm_eps, out)


def kda_decode_aiter(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: DecodeSeqs, out: torch.Tensor,
) -> None:
    qkv, forget_logits, beta_logits, output_gate_logits = inputs
    conv_state, recurrent_state, conv_layout = cache
    state_indices, spec_state_indices, num_accepted_tokens = seqs
    from aiter.ops.triton.attention.kda import fused_recurrent_kda

    from kdaserve.ops.kda.conv import causal_conv_update_fwd
    from kdaserve.ops.norm import gated_rms_norm_fwd

    _require_params(fused_recurrent_kda, ("ssm_state_indices", "num_accepted_tokens", "pad_slot_guard", "state_v_first",
                                          "inplace_final_state", "out"), "fused_recurrent_kda")
    T, H, D, N, m = check_decode_step(inputs, weights, cache, seqs, out)
    if N == 0:
        return
    if recurrent_state.dtype != torch.float32:
        raise ValueError(f"aiter decode updates fp32 recurrent states only, got {recurrent_state.dtype}")
    y = causal_conv_update_fwd(qkv, weights.conv_weight, conv_state, state_indices, num_accepted_tokens, conv_layout)
    q, k, v = y.view(N, m, 3, H, D).unbind(2)
    o = torch.empty(N, m, H, D, dtype=q.dtype, device=q.device)
    if spec_state_indices is None:
        slots, accepted = state_indices, None
    else:
        # A padding row (first slot <= 0) gets all-zero slots, so the pad guard skips every write of it.
        slots = torch.where(spec_state_indices[:, :1] > 0, spec_state_indices, 0).to(spec_state_indices.dtype).contiguous()
        accepted = num_accepted_tokens.clamp(1, m).to(torch.int32).contiguous()
    fused_recurrent_kda(
        q, k, v, forget_logits.reshape(N, m, H, D).contiguous(), beta_logits.reshape(N, m, H).contiguous(),
        A_log=weights.A_log.float().contiguous(),
        dt_bias=weights.dt_bias.float().reshape(H, D).contiguous(), initial_state=recurrent_state, scale=D**-0.5,
        output_final_state=False, inplace_final_state=True, state_v_first=True, ssm_state_indices=slots,
        num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=weights.lower_bound, out=o, pad_slot_guard=True,
    )
    row_slots = state_indices if spec_state_indices is None else spec_state_indices[:, 0]
    gated_rms_norm_fwd(o.view(T, H, D), output_gate_logits, weights.norm_weight, weights.norm_eps, out,
                       row_state_indices=row_slots, tokens_per_index=m)
