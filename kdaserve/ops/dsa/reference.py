"""The DSA indexer's selection with k-pool compression, in plain torch: the definition kernels meet.

Per context token the indexer cache holds a key k = LayerNorm(wk x) and gate logits g = G x
(each index_head_dim wide). Context positions are grouped into pools of `kpool` tokens from
position 0; a pool is *complete* when all its tokens exist. Per complete pool p:

    pool_key[p] = sum_t softmax_t(g[t] + ape[t mod kpool]) * k[t]        (per channel, over the pool)

Per query (its index heads q [Hi, Di] = wq_b(q_resid), weights w [Hi] = weights_proj(x) Hi^-0.5):

    score[p] = sum_h w[h] relu(q[h] . pool_key[p] Di^-0.5)

The query may select a pool whose last token is at or before its own position; it keeps the
top min(index_topk / kpool, candidates) pools and, with `always_select_tail`, the tokens of its
own incomplete pool (positions from the last pool border to itself). While a query sees at most
index_topk + kpool - 1 tokens this is every token before it: dense causal attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dsa_select_reference(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor,
                         ape: torch.Tensor, positions: torch.Tensor, *, topk: int, kpool: int,
                         always_select_tail: bool = True) -> torch.Tensor:
    """q [B, n, Hi, Di], w [B, n, Hi] fp32 (already x Hi^-0.5), keys / gates [B, C, Di] (each row's
    context from position 0; rows past a context are never selected), ape [kpool, Di], positions
    [B, n] int64 (each query's position, < C) -> allowed [B, n, C] bool. No host sync."""
    B, n, Hi, Di = q.shape
    C = keys.shape[1]
    P = C // kpool
    allowed = torch.zeros(B, n, C, dtype=torch.bool, device=q.device)
    pos = positions.long()
    if P:
        pooled = slice(0, P * kpool)
        logits = gates[:, pooled].reshape(B, P, kpool, Di).float() + ape.float()
        probs = logits.softmax(dim=2).to(keys.dtype)
        pool_keys = (probs * keys[:, pooled].reshape(B, P, kpool, Di)).sum(dim=2)              # [B, P, Di]
        scores = torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1))     # [B, n, Hi, P]
        scores = F.relu(scores * Di**-0.5)
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)                              # [B, n, P]
        ends = torch.arange(P, device=q.device) * kpool + (kpool - 1)
        candidate = ends[None, None, :] <= pos[..., None]
        index = index.masked_fill(~candidate, torch.finfo(index.dtype).min)
        chosen = index.topk(min(topk // kpool, P), dim=-1).indices
        picked = torch.zeros_like(candidate).scatter_(-1, chosen, candidate.gather(-1, chosen))
        allowed[..., pooled] = picked.repeat_interleave(kpool, dim=-1)
    if always_select_tail:
        visible = pos + 1
        start = visible - visible.remainder(kpool)
        t = torch.arange(C, device=q.device)
        allowed |= (t >= start[..., None]) & (t < visible[..., None])
    return allowed
