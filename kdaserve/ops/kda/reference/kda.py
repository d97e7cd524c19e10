"""The whole KDA core of one layer, after the projections: conv -> l2norm/gate/beta -> delta rule
-> gated RMSNorm. These two functions fix the calling convention every prefill and decode backend
implements (`kdaserve/ops/*`), so backends are interchangeable.

Inputs, for T tokens of a step:
  qkv          [T, 3P] pre-conv q|k|v (a column slice of the projection output is fine)
  forget_logits           [T, H, D] or [T, P] forget-gate logits (f_a @ W_fb)
  beta_logits  [T, H] (a column slice of the projection output is fine)
  output_gate_logits           [T, H, D] or [T, P] output-gate logits (g_a @ W_gb)
  conv_state   the bf16 conv-state pool (SD or DS layout), updated in place
  recurrent_state  [num_slots, H, V, K] pool (fp32 or bf16), updated in place
  out          [T, H, D] caller-provided output, written for every sequence whose slot is > 0
"""

from __future__ import annotations

import torch

from kdaserve.ops.kda.checks import check_decode_step, check_prefill_step
from kdaserve.ops.kda.reference.chunked import kda_chunked_varlen
from kdaserve.ops.kda.reference.conv import causal_conv_update, causal_conv_varlen
from kdaserve.ops.kda.reference.gates import beta_sigmoid, kda_gate, l2norm_qk
from kdaserve.ops.kda.reference.norm import gated_rms_norm
from kdaserve.ops.kda.reference.recurrence import kda_recurrent_spec, kda_recurrent_varlen
from kdaserve.ops.kda.types import DecodeSeqs, KDACache, KDAInputs, KDAWeights, PrefillSeqs


def kda_qkv_prepare(y: torch.Tensor, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split conv output [T, 3P] into q, k, v [T, H, D]; l2norm q and k, scale folded into q."""
    T = y.shape[0]
    q, k, v = y.view(T, 3, H, D).unbind(1)
    q, k = l2norm_qk(q, k)
    return q, k, v


def _finish(o, output_gate_logits, weights, out, valid_rows):
    T, H, D = o.shape
    y = gated_rms_norm(o, output_gate_logits.reshape(T, H, D), weights.norm_weight, weights.norm_eps)
    out_v = out.view(T, H, D)
    out_v[valid_rows] = y[valid_rows].to(out.dtype)


def kda_prefill_reference(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: PrefillSeqs, out: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> None:
    """Varlen prefill (any lengths, mixed steps included). chunk_size=None runs the token loop;
    16/32/64 run the chunked form (same result, much faster for long sequences). State
    checkpoints (seqs.checkpoints) are computed apart, before the step (_take_checkpoints)."""
    if seqs.checkpoints is not None and any(seqs.checkpoints.offsets_cpu):
        _take_checkpoints(inputs, weights, cache, seqs, chunk_size)
    qkv, forget_logits, beta_logits, output_gate_logits = inputs
    conv_state, recurrent_state, conv_layout = cache
    cu_seqlens, state_indices, has_initial_state, cu_seqlens_cpu = seqs
    T, H, D, _ = check_prefill_step(inputs, weights, cache, seqs, out)
    y = causal_conv_varlen(qkv, weights.conv_weight, conv_state, cu_seqlens, state_indices, has_initial_state, conv_layout)
    q, k, v = kda_qkv_prepare(y, H, D)
    gk = kda_gate(forget_logits.reshape(T, H, D), weights.A_log, weights.dt_bias, weights.lower_bound,
                  weights.gate_dtype)
    beta = beta_sigmoid(beta_logits)
    args = (q, k, v, gk, beta, recurrent_state, cu_seqlens, state_indices, has_initial_state)
    o = kda_recurrent_varlen(*args) if chunk_size is None else kda_chunked_varlen(*args, chunk_size=chunk_size)
    cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    valid = torch.zeros(T, dtype=torch.bool)
    for n, slot in enumerate(state_indices.tolist()):
        valid[cu[n] : cu[n + 1]] = slot > 0
    _finish(o, output_gate_logits, weights, out, valid.to(out.device))


def _take_checkpoints(inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: PrefillSeqs,
                      chunk_size: int | None) -> None:
    """The definition of a checkpoint, on copies of the sequences' own slots (so the step's own
    outputs and states do not depend on whether checkpoints were asked for): round r prefills every
    sequence's r-th piece (the tokens up to its next checkpoint) from the state the previous round
    left, then copies the states reached into the checkpoint slots."""
    from kdaserve.ops.kda.types import conv_state_rows

    cu = (seqs.cu_seqlens_cpu if seqs.cu_seqlens_cpu is not None else seqs.cu_seqlens).tolist()
    dev = inputs.qkv.device
    slots_of = seqs.checkpoints.slots.tolist()
    owners = [n for n, offs in enumerate(seqs.checkpoints.offsets_cpu) if offs and int(seqs.state_indices[n]) > 0]
    if not owners:
        return
    own = torch.tensor([0] + [int(seqs.state_indices[n]) for n in owners], device=dev)
    scratch = KDACache(cache.conv_state[own].clone(), cache.recurrent_state[own].clone(), cache.conv_layout)
    rows_of = conv_state_rows(cache.conv_state, cache.conv_layout)
    scratch_rows = conv_state_rows(scratch.conv_state, cache.conv_layout)
    cuts = {n: [0, *seqs.checkpoints.offsets_cpu[n]] for n in owners}
    has_state = seqs.has_initial_state[torch.tensor(owners, device=dev)].clone()
    for r in range(max(len(c) for c in cuts.values()) - 1):
        members = [i for i, n in enumerate(owners) if r + 1 < len(cuts[n])]
        rows = torch.cat([torch.arange(cu[owners[i]] + cuts[owners[i]][r], cu[owners[i]] + cuts[owners[i]][r + 1])
                          for i in members]).to(dev)
        lens = torch.tensor([cuts[owners[i]][r + 1] - cuts[owners[i]][r] for i in members], dtype=torch.int32)
        piece_cu = torch.zeros(len(members) + 1, dtype=torch.int32)
        piece_cu[1:] = lens.cumsum(0)
        idx = torch.tensor(members, device=dev)
        part = PrefillSeqs(piece_cu.to(dev), (idx + 1).to(torch.int32), has_state[idx], piece_cu)
        out = torch.empty(rows.numel(), weights.num_heads, weights.head_dim, dtype=inputs.qkv.dtype, device=dev)
        kda_prefill_reference(KDAInputs(*(t[rows] for t in inputs)), weights, scratch, part, out, chunk_size=chunk_size)
        has_state[idx] = True
        for i in members:
            ck = slots_of[owners[i]][r]
            cache.recurrent_state[ck] = scratch.recurrent_state[i + 1]
            rows_of[ck] = scratch_rows[i + 1]


def kda_decode_reference(
    inputs: KDAInputs, weights: KDAWeights, cache: KDACache, seqs: DecodeSeqs, out: torch.Tensor,
) -> None:
    """One token per sequence, or S+1 per sequence for a speculative verify (`spec_state_indices`
    [N, S+1] with `num_accepted_tokens` [N]). The conv state lives in slot `state_indices[n]`;
    the recurrent state in `state_indices[n]`, or per token in `spec_state_indices` when verifying.
    Rows whose slot is <= 0 are padding: nothing is read or written for them, `out` included."""
    qkv, forget_logits, beta_logits, output_gate_logits = inputs
    conv_state, recurrent_state, conv_layout = cache
    state_indices, spec_state_indices, num_accepted_tokens = seqs
    T, H, D, N, m = check_decode_step(inputs, weights, cache, seqs, out)
    y = causal_conv_update(qkv, weights.conv_weight, conv_state, state_indices, num_accepted_tokens, conv_layout)
    q, k, v = kda_qkv_prepare(y, H, D)
    gk = kda_gate(forget_logits.reshape(T, H, D), weights.A_log, weights.dt_bias, weights.lower_bound,
                  weights.gate_dtype)
    beta = beta_sigmoid(beta_logits)
    if spec_state_indices is None:
        cu = torch.arange(N + 1, device=qkv.device, dtype=torch.int32)
        has_state = torch.ones(N, dtype=torch.bool, device=qkv.device)
        o = kda_recurrent_varlen(q, k, v, gk, beta, recurrent_state, cu, state_indices, has_state)
        valid = state_indices > 0
    else:
        o = kda_recurrent_spec(q, k, v, gk, beta, recurrent_state, spec_state_indices, num_accepted_tokens)
        valid = (spec_state_indices[:, :1] > 0).expand(N, m).reshape(T)
    _finish(o, output_gate_logits, weights, out, valid)
