"""The chunked form of the KDA delta rule: the blueprint that chunked kernels follow.

Within a chunk of C tokens, with g = cumsum(gk) (inclusive, per channel) and the state S0 at the
chunk's start, write Gamma_t = exp(g_t). The recurrence unrolls into (per head):

  intra-chunk matrices  A[t, i]   = beta_t * sum_c k_t[c] k_i[c] exp(g_t[c] - g_i[c])   (i < t)
                        Aqk[t, i] =          sum_c q_t[c] k_i[c] exp(g_t[c] - g_i[c])   (i <= t)
  triangular solve      T = (I + A)^-1 ;  W = T diag(beta) (K * Gamma) ;  U~ = T diag(beta) V
  state pass            U  = U~ - W S0^T                         (the corrected values u_t)
                        O  = (Q * Gamma) S0^T + Aqk U
                        S1 = S0 diag(Gamma_C) + U^T (K * exp(g_C - g))

Every exponent above is a difference g_t - g_i with t >= i (or g_t alone), so it is <= 0 and
nothing overflows whatever the chunk size: kernels that factor exp(g_t - g_i) into
exp(g_t - a) * exp(a - g_i) must pick the anchor `a` inside a short sub-chunk (16 tokens at
LB = -5 keeps |g - a| <= 80 < 88, fp32's exp limit), which is why they work in 16-token blocks.
"""

from __future__ import annotations

import torch

from kdaserve.ops.kda.reference.gates import compute_dtype

CHUNK_SIZES = (16, 32, 64)


def chunk_intra_matrices(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A (strictly lower, beta-scaled) and Aqk (lower incl. diagonal) for one chunk, all heads.

    q, k, g: [H, C, K] with g the inclusive cumsum of gk; beta: [H, C]. Returns two [H, C, C].
    """
    C = q.shape[1]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = g[:, :, None, :] - g[:, None, :, :]  # [H, t, i, K]: g_t - g_i
    decay = torch.where(causal[None, :, :, None], diff, torch.full_like(diff, -torch.inf)).exp()
    Akk = torch.einsum("htc,hic,htic->hti", k, k, decay)
    Aqk = torch.einsum("htc,hic,htic->hti", q, k, decay)
    A = (Akk * beta[:, :, None]).tril(-1)
    return A, Aqk


def chunk_solve(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 rhs for strictly lower A [H, C, C] by forward substitution (unit diagonal)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)


def chunk_forward(
    S0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk for all heads: S0 [H, V, K]; q/k/gk [H, C, K]; v [H, C, V]; beta [H, C] -> (O, S1)."""
    g = gk.cumsum(1)
    A, Aqk = chunk_intra_matrices(q, k, g, beta)
    gamma = g.exp()
    W = chunk_solve(A, beta[..., None] * (k * gamma))
    U_tilde = chunk_solve(A, beta[..., None] * v)
    U = U_tilde - W @ S0.transpose(1, 2)
    O = (q * gamma) @ S0.transpose(1, 2) + Aqk @ U
    g_last = g[:, -1:, :]
    S1 = S0 * g_last.exp() + U.transpose(1, 2) @ (k * (g_last - g).exp())
    return O, S1


def kda_chunked_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Same contract as `kda_recurrent_varlen`, computed chunk by chunk (chunks never cross sequences)."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    dt = compute_dtype(q, k, v, gk, beta, state_pool)
    o = torch.zeros(v.shape, dtype=dt, device=v.device)
    cu = cu_seqlens.tolist()
    head_first = lambda x: x.to(dt).transpose(0, 1)  # noqa: E731  [T, H, ...] -> [H, T, ...]
    for n, slot in enumerate(state_indices.tolist()):
        if slot <= 0:
            continue
        S = state_pool[slot].to(dt) if bool(has_initial_state[n]) else torch.zeros_like(state_pool[slot], dtype=dt)
        for c0 in range(cu[n], cu[n + 1], chunk_size):
            c1 = min(c0 + chunk_size, cu[n + 1])
            O, S = chunk_forward(
                S, head_first(q[c0:c1]), head_first(k[c0:c1]), head_first(v[c0:c1]),
                head_first(gk[c0:c1]), beta[c0:c1].to(dt).transpose(0, 1),
            )
            o[c0:c1] = O.transpose(0, 1)
        state_pool[slot] = S.to(state_pool.dtype)
    return o
