"""The gated delta rule as a plain token loop: the ground truth for every KDA kernel.

Per head, state S [V, K] (V-major, K contiguous), for each token t:
    S <- S * exp(gk_t)            (decay along K)
    u  = beta_t * (v_t - S k_t)
    S <- S + u k_t^T
    o_t = S q_t                   (from the updated state)
q, k are already l2-normalized (q scaled by D^-0.5); gk is the log-decay, beta in (0, 1).
"""

from __future__ import annotations

import torch

from kdaserve.ops.kda.reference.gates import compute_dtype


def delta_rule_step(
    S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for all heads: S [H, V, K], q/k/gk [H, K], v [H, V], beta [H] -> (S', o [H, V])."""
    S = S * gk.exp()[:, None, :]
    u = beta[:, None] * (v - torch.einsum("hvk,hk->hv", S, k))
    S = S + u[:, :, None] * k[:, None, :]
    return S, torch.einsum("hvk,hk->hv", S, q)


def kda_recurrent_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Token loop over varlen sequences; q/k/gk [T, H, K], v [T, H, V], beta [T, H].

    Sequence n starts from `state_pool[state_indices[n]]` when `has_initial_state[n]`, else zeros,
    and its final state is written back into the same slot. Slots <= 0 are skipped (o rows zero).
    Returns o [T, H, V] in the compute dtype.
    """
    dt = compute_dtype(q, k, v, gk, beta, state_pool)
    o = torch.zeros(v.shape, dtype=dt, device=v.device)
    cu = cu_seqlens.tolist()
    for n, slot in enumerate(state_indices.tolist()):
        if slot <= 0:
            continue
        S = state_pool[slot].to(dt) if bool(has_initial_state[n]) else torch.zeros_like(state_pool[slot], dtype=dt)
        for t in range(cu[n], cu[n + 1]):
            S, o[t] = delta_rule_step(S, q[t].to(dt), k[t].to(dt), v[t].to(dt), gk[t].to(dt), beta[t].to(dt))
        state_pool[slot] = S.to(state_pool.dtype)
    return o


def kda_recurrent_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    spec_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> torch.Tensor:
    """Speculative verify: S+1 tokens per sequence, laid out [N*(S+1), ...].

    Sequence n starts from slot `spec_state_indices[n, num_accepted_tokens[n]-1]` (the state after
    the last accepted token of the previous step) and stores the state after its token t into
    `spec_state_indices[n, t]`, so the next step can resume from whichever draft is accepted.
    Rows whose first slot is <= 0 are padding and are skipped.
    """
    N, S1 = spec_state_indices.shape
    if q.shape[0] != N * S1:
        raise ValueError(f"speculative verify needs {N}x{S1} = {N * S1} tokens, got {q.shape[0]}")
    dt = compute_dtype(q, k, v, gk, beta, state_pool)
    o = torch.zeros(v.shape, dtype=dt, device=v.device)
    slots = spec_state_indices.tolist()
    accepted = num_accepted_tokens.tolist()
    for n in range(N):
        if slots[n][0] <= 0:
            continue
        if not 1 <= accepted[n] <= S1:
            raise ValueError(f"num_accepted_tokens[{n}] = {accepted[n]} must lie in [1, {S1}]")
        S = state_pool[slots[n][accepted[n] - 1]].to(dt)
        for j in range(S1):
            t = n * S1 + j
            S, o[t] = delta_rule_step(S, q[t].to(dt), k[t].to(dt), v[t].to(dt), gk[t].to(dt), beta[t].to(dt))
            if slots[n][j] > 0:
                state_pool[slots[n][j]] = S.to(state_pool.dtype)
    return o
