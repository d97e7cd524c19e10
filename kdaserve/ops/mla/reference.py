"""The MLA attention math in plain torch, the definition the kernels meet: fp32 math (fp64 when
the inputs are fp64)."""

from __future__ import annotations

import torch


def mla_decode_reference(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row, absorbed form. q_latent [B, H, L], q_pe [B, H, R], cache [NB, BS, L+R],
    block_tables [B, width] int32, context_lens [B] (>= 1) -> latent output [B, H, L] (q's dtype).
    Gathers the whole table width (fixed shapes, no host sync) and masks past each context; masked
    rows are zeroed so garbage in unused cache rows never meets a zero weight. `allowed` [B, width *
    block_size] bool: sparse attention (DSA), only these context positions (within the context)."""
    B, H, L = q_latent.shape
    acc = torch.promote_types(q_latent.dtype, torch.float32)
    rows = cache[block_tables.long()].reshape(B, -1, cache.shape[-1]).to(acc)   # [B, W*BS, L+R]
    visible = torch.arange(rows.shape[1], device=rows.device)[None, :] < context_lens[:, None].long()
    if allowed is not None:
        visible = visible & allowed
    rows = torch.where(visible[:, :, None], rows, rows.new_zeros(()))
    latent, pe = rows[..., :L], rows[..., L:]
    scores = (torch.einsum("bhl,btl->bht", q_latent.to(acc), latent)
              + torch.einsum("bhr,btr->bht", q_pe.to(acc), pe)) * scale
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bht,btl->bhl", probs, latent).to(q_latent.dtype)


def mla_prefill_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                          v: torch.Tensor, query_lens: list[int], context_lens: list[int], scale: float,
                          allowed: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Varlen causal attention of each sequence's new tokens over its whole context; with `allowed`
    (one [query_len, context_len] bool mask per sequence: DSA's selection) over those tokens only.
    q_nope [T, H, Dn], q_pe [T, H, R]; k_nope [C, H, Dn], k_pe [C, R] (one per token, every head),
    v [C, H, Dv], sequences back to back (T = sum query_lens, C = sum context_lens); query i of a
    sequence sits at position context_len - query_len + i. -> [T, H, Dv] in q's dtype."""
    out = torch.empty(q_nope.shape[0], q_nope.shape[1], v.shape[2], dtype=q_nope.dtype, device=q_nope.device)
    acc = torch.promote_types(q_nope.dtype, torch.float32)
    q0 = k0 = 0
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        qn, qp = q_nope[q0 : q0 + n].to(acc), q_pe[q0 : q0 + n].to(acc)
        kn, kp, vv = k_nope[k0 : k0 + ctx].to(acc), k_pe[k0 : k0 + ctx].to(acc), v[k0 : k0 + ctx].to(acc)
        s = (torch.einsum("ihd,jhd->hij", qn, kn) + torch.einsum("ihr,jr->hij", qp, kp)) * scale
        mask = torch.ones(n, ctx, dtype=torch.bool, device=s.device).tril(diagonal=ctx - n)
        if allowed is not None:
            mask = mask & allowed[i]
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        out[q0 : q0 + n] = torch.einsum("hij,jhd->ihd", p, vv).to(out.dtype)
        q0, k0 = q0 + n, k0 + ctx
    return out
