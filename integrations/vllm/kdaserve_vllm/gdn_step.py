"""One vLLM KDA step through kdaserve's backends, from vLLM's `GDNAttentionMetadata` (read by
attribute only: this module imports nothing of vLLM, so tests can run it on vLLM's layouts without
vLLM). kda_core.py calls it from inside the layers' eager-broken `_forward`."""

from __future__ import annotations

import torch

from kdaserve.backends.step import KDACache, KDAInputs, KDAStepMetadata
from kdaserve.layers.kda_routing import run_kda_step
from kdaserve.ops.kda.types import KDAWeights


def run_gdn_step(m, backends, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor, cache: KDACache, weights: KDAWeights, num_spec: int) -> None:
    """The step's KDA core into core_attn_out [1, T_pad, H, D], gated norm included, for the
    `m.num_actual_tokens` real rows of vLLM's inputs (mixed_qkv [T_pad, 3P], g1 [1, T_pad, H, D],
    beta [1, T_pad, H], g2 [T_pad, H, D]: views of its projections, strides as they come); padding
    rows are never read or written. Speculative verifies apart (spec_token_indx), the rest as one
    varlen prefill when any prefill is present (decodes then count as 1-token prefills with their
    state), else as plain decodes."""
    T = m.num_actual_tokens
    g1, beta, g2 = g1[0, :T], beta[0, :T], g2[:T]
    mixed_qkv = mixed_qkv[:T]
    out = core_attn_out[0, :T]
    H, D = out.shape[1], out.shape[2]
    spec_only = m.spec_sequence_masks is not None and m.num_prefills == 0 and m.num_decodes == 0
    if m.spec_sequence_masks is not None:
        n, width = m.num_spec_decodes, m.spec_state_indices_tensor.shape[1]
        slots = m.spec_state_indices_tensor[:n]
        meta = KDAStepMetadata(num_decodes=n, num_decode_tokens=n * width, decode_state_indices=slots[:, 0],
                               spec_state_indices=slots, num_accepted_tokens=m.num_accepted_tokens[:n])
        rows = slice(0, T) if spec_only else m.spec_token_indx
        pad = None
        if m.num_spec_decode_tokens != n * width:
            # vLLM verifies fewer tokens where it found fewer drafts; kdaserve's verify takes S+1
            # rows per sequence: the missing rows are zeros whose states land in slots past the
            # sequence's tokens, which vLLM never resumes from (it resumes at the accepted count).
            pad = (ragged_rows(m.spec_query_start_loc[: n + 1], n, width, m.num_spec_decode_tokens), n * width)
        part = _run(backends, meta, rows, mixed_qkv, g1, g2, beta, cache, weights, H, D, pad)
        if spec_only:
            out.copy_(part)
            return
        out.index_copy_(0, m.spec_token_indx, part)
    rows = slice(0, T) if m.spec_sequence_masks is None else m.non_spec_token_indx
    n_tokens = T if m.spec_sequence_masks is None else m.non_spec_token_indx.numel()
    n_seqs = m.num_prefills + m.num_decodes
    slots = m.non_spec_state_indices_tensor[:n_seqs]
    if m.num_prefills:
        cu = m.non_spec_query_start_loc[: n_seqs + 1]
        meta = KDAStepMetadata(num_prefills=n_seqs, num_prefill_tokens=n_tokens, prefill_cu_seqlens=cu,
                               prefill_state_indices=slots, prefill_has_initial_state=m.has_initial_state[:n_seqs])
    else:
        meta = KDAStepMetadata(num_decodes=n_seqs, num_decode_tokens=n_seqs, decode_state_indices=slots)
    part = _run(backends, meta, rows, mixed_qkv, g1, g2, beta, cache, weights, H, D)
    if m.num_prefills and num_spec:
        history_to_front(cache.conv_state, slots, weights.conv_weight.shape[-1], num_spec, cache.conv_layout == "SD")
    if isinstance(rows, slice):
        out.copy_(part)
    else:
        out.index_copy_(0, rows, part)


def _run(backends, meta: KDAStepMetadata, rows: torch.Tensor | slice, mixed_qkv, g1, g2, beta, cache, weights,
         H: int, D: int, pad: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """One part of the step (tokens `rows`) through kdaserve's router; returns its output [n, H, D].
    `pad` = (destination row of each token, rows in all): the tokens are spread over that many
    zero rows first (a ragged verify padded to S+1 rows per sequence) and gathered back after."""
    take = (lambda x: x[rows]) if isinstance(rows, slice) else (lambda x: x.index_select(0, rows))
    parts = [take(mixed_qkv), take(g1), take(beta), take(g2)]
    if pad is not None:
        dest, total = pad
        parts = [x.new_zeros(total, *x.shape[1:]).index_copy_(0, dest, x) for x in parts]
    inputs = KDAInputs(qkv=parts[0], forget_logits=parts[1], beta_logits=parts[2], output_gate_logits=parts[3])
    out = torch.empty(inputs.qkv.shape[0], H, D, dtype=g2.dtype, device=g2.device)
    run_kda_step(backends.build_step(meta), inputs, weights, cache, out, backends)
    return out if pad is None else out.index_select(0, pad[0])


def fail_on_nan(tensors: list[torch.Tensor], message: str) -> None:
    """Stop the engine when any of `tensors` holds NaN, without waiting for the device: on a GPU a
    device-side assertion (the process stops at its next synchronization), on a CPU an exception
    carrying `message`. A NaN hidden state otherwise samples token 0 at every step, silently."""
    bad = torch.stack([t.isnan().any() for t in tensors]).any()
    torch._assert_async(~bad, message)


def ragged_rows(cu: torch.Tensor, n: int, rows_per_seq: int, num_tokens: int) -> torch.Tensor:
    """Row of each verify token when every sequence gets `rows_per_seq` rows (no host sync)."""
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(n, device=cu.device), lengths, output_size=num_tokens)
    within = torch.arange(num_tokens, device=cu.device) - cu[:-1].index_select(0, seq)
    return seq * rows_per_seq + within


def history_to_front(conv_state: torch.Tensor, slots: torch.Tensor, conv_width: int, num_spec: int, sd: bool) -> None:
    """With speculation the conv state holds W-1+S rows. kdaserve's prefill leaves the newest W-1
    inputs at the end (where its verify resumes with S+1 accepted); vLLM's next verify resumes
    after 1 accepted row, from the front. Move them there (no host sync: padding slots copy
    their own rows back)."""
    W1, S = conv_width - 1, num_spec
    idx = slots.long().clamp_min(0)
    rows = conv_state.index_select(0, idx)
    tail = rows[:, S:S + W1] if sd else rows[:, :, S:S + W1]
    valid = (slots > 0).view(-1, 1, 1)
    if sd:
        rows[:, :W1] = torch.where(valid, tail, rows[:, :W1])
    else:
        rows[:, :, :W1] = torch.where(valid, tail, rows[:, :, :W1])
    conv_state.index_copy_(0, idx, rows)
