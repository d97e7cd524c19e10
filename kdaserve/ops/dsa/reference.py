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


def dsa_pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """keys / gates [B, C, Di] -> the complete pools' keys [B, C // kpool, Di] (keys' dtype)."""
    B, C, Di = keys.shape
    P = C // kpool
    pooled = slice(0, P * kpool)
    logits = gates[:, pooled].reshape(B, P, kpool, Di).float() + ape.float()
    probs = logits.softmax(dim=2).to(keys.dtype)
    return (probs * keys[:, pooled].reshape(B, P, kpool, Di)).sum(dim=2)


def dsa_index_scores_reference(q: torch.Tensor, w: torch.Tensor, pool_keys: torch.Tensor, positions: torch.Tensor,
                               kpool: int) -> torch.Tensor:
    """q [B, n, Hi, Di], w [B, n, Hi] fp32, pool_keys [B, P, Di], positions [B, n] -> the index
    scores [B, n, P] fp32, pools the query may not select (not complete before it) at fp32's min."""
    Di = q.shape[-1]
    P = pool_keys.shape[1]
    scores = torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1))     # [B, n, Hi, P]
    scores = F.relu(scores * Di**-0.5)
    index = torch.matmul(w.float().unsqueeze(-2), scores).squeeze(-2)                      # [B, n, P]
    ends = torch.arange(P, device=q.device) * kpool + (kpool - 1)
    return index.masked_fill(ends[None, None, :] > positions.long()[..., None], torch.finfo(torch.float32).min)


def dsa_choose(index: torch.Tensor, positions: torch.Tensor, C: int, *, topk: int, kpool: int,
               always_select_tail: bool) -> torch.Tensor:
    """index [B, n, P] (unselectable pools at fp32's min) -> allowed [B, n, C] bool: the best
    min(topk / kpool, P) selectable pools and, with `always_select_tail`, the query's own incomplete pool."""
    B, n, P = index.shape
    pos = positions.long()
    allowed = torch.zeros(B, n, C, dtype=torch.bool, device=index.device)
    if P:
        ends = torch.arange(P, device=index.device) * kpool + (kpool - 1)
        candidate = ends[None, None, :] <= pos[..., None]
        chosen = index.topk(min(topk // kpool, P), dim=-1).indices
        picked = torch.zeros_like(candidate).scatter_(-1, chosen, candidate.gather(-1, chosen))
        allowed[..., : P * kpool] = picked.repeat_interleave(kpool, dim=-1)
    if always_select_tail:
        visible = pos + 1
        start = visible - visible.remainder(kpool)
        t = torch.arange(C, device=index.device)
        allowed |= (t >= start[..., None]) & (t < visible[..., None])
    return allowed


def dsa_choose_indices(index: torch.Tensor, positions: torch.Tensor, *, topk: int, kpool: int,
                       always_select_tail: bool) -> torch.Tensor:
    """The same choice as `dsa_choose`, as context positions: [B, n, topk + kpool - 1] int32, the
    chosen pools' tokens then the query's incomplete pool, -1 where nothing is chosen (what a
    sparse attention kernel reads; no [B, n, C] mask)."""
    B, n, P = index.shape
    pos = positions.long()
    parts = []
    K = min(topk // kpool, P)
    if K:
        ends = torch.arange(P, device=index.device) * kpool + (kpool - 1)
        candidate = ends[None, None, :] <= pos[..., None]
        chosen = index.topk(K, dim=-1).indices
        ok = candidate.gather(-1, chosen)
        tokens = chosen[..., None] * kpool + torch.arange(kpool, device=index.device)
        parts.append(torch.where(ok[..., None], tokens, -1).flatten(-2))
    if always_select_tail and kpool > 1:
        visible = pos + 1
        start = visible - visible.remainder(kpool)
        tail = start[..., None] + torch.arange(kpool - 1, device=index.device)
        parts.append(torch.where(tail < visible[..., None], tail, -1))
    width = topk + (kpool - 1 if always_select_tail else 0)
    out = torch.cat(parts, dim=-1) if parts else index.new_empty(B, n, 0, dtype=torch.long)
    return torch.nn.functional.pad(out, (0, width - out.shape[-1]), value=-1).to(torch.int32)


def dsa_select_reference(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor,
                         ape: torch.Tensor, positions: torch.Tensor, *, topk: int, kpool: int,
                         always_select_tail: bool = True, scores=dsa_index_scores_reference) -> torch.Tensor:
    """q [B, n, Hi, Di], w [B, n, Hi] fp32 (already x Hi^-0.5), keys / gates [B, C, Di] (each row's
    context from position 0; rows past a context are never selected), ape [kpool, Di], positions
    [B, n] int64 (each query's position, < C) -> allowed [B, n, C] bool. No host sync. `scores`:
    the index-score implementation (this reference, or ops/dsa/triton_scores.py)."""
    pool_keys = dsa_pool_keys(keys, gates, ape, kpool)
    index = scores(q, w, pool_keys, positions, kpool)
    return dsa_choose(index, positions, keys.shape[1], topk=topk, kpool=kpool, always_select_tail=always_select_tail)
