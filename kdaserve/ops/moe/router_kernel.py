"""The router after its logits in one Triton launch: scores, the bias that only chooses, the top-k,
the chosen scores renormalized and scaled (the definition: router.route_tokens' torch path).

The torch path is ~8 kernels per MoE layer (sigmoid, the bias add, top-k, gather, sum, divide,
scale), each a launch and a gap in a CUDA graph at decode. One program routes
BT tokens; each holds its row of E scores and picks the k best by k rounds of (max, first index of
the max, mask it out), so the experts come in descending choice order as torch.topk gives them
(ties, which random fp32 scores do not make, go to the lower expert id). Routing restricted to
groups (DeepSeek-V3, Ling-3: GROUPS equal groups of consecutive experts, a group's score the sum of
its two best choice scores, only the TOPK_GROUPS best groups open) is done in the same program:
one masked max pair per group, TOPK_GROUPS rounds over the group scores, then the closed groups'
experts masked out before the top-k.

With `extra_expert` every token also gets that expert with weight 1, as a last column: the shared
expert run by the fused experts' kernels as one more expert (layers/moe.py, at decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat


@triton.jit
def _open_groups_only(choice, cols, BT: tl.constexpr, E_P: tl.constexpr, GROUPS: tl.constexpr,
                      TOPK_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, G_P: tl.constexpr):
    """`choice` [BT, E_P] with the experts of all but each row's TOPK_GROUPS best groups at -inf; a
    group's score is the sum of its two best choice scores (its best alone for groups of one)."""
    gid = cols // GROUP_SIZE                     # padding columns fall past the last group
    gcols = tl.arange(0, G_P)
    gscore = tl.full([BT, G_P], float("-inf"), tl.float32)
    for g in tl.static_range(GROUPS):
        mine = tl.where(gid[None, :] == g, choice, float("-inf"))
        m1 = tl.max(mine, axis=1)
        score = m1
        if GROUP_SIZE > 1:
            i1 = tl.min(tl.where(mine == m1[:, None], cols[None, :], E_P), axis=1)
            score = m1 + tl.max(tl.where(cols[None, :] == i1[:, None], float("-inf"), mine), axis=1)
        gscore = tl.where(gcols[None, :] == g, score[:, None], gscore)
    open_groups = tl.zeros([BT, G_P], tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.max(gscore, axis=1)
        gi = tl.min(tl.where(gscore == best[:, None], gcols[None, :], G_P), axis=1)
        hit = gcols[None, :] == gi[:, None]
        open_groups = tl.where(hit, 1, open_groups)
        gscore = tl.where(hit, float("-inf"), gscore)
    is_open = tl.zeros([BT, E_P], tl.int32)
    for g in tl.static_range(GROUPS):
        g_open = tl.sum(tl.where(gcols[None, :] == g, open_groups, 0), axis=1)
        is_open = tl.where(gid[None, :] == g, g_open[:, None], is_open)
    return tl.where(is_open != 0, choice, float("-inf"))


@triton.jit
def _route_kernel(
    logits_ptr, stride_l, bias_ptr, w_ptr, ids_ptr, T, E, scale, extra_id,
    K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr, BT: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, EXTRA: tl.constexpr = 0,
    GROUPS: tl.constexpr = 1, TOPK_GROUPS: tl.constexpr = 1, GROUP_SIZE: tl.constexpr = 1, G_P: tl.constexpr = 2,
):
    """EXTRA (0 or 1): a last column of expert `extra_id` with weight 1 (rows of K + EXTRA).
    GROUPS > 1: only experts of the TOPK_GROUPS best groups (of GROUP_SIZE consecutive experts) are
    chosen; G_P, GROUPS rounded up to a power of two."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, E_P)
    row_ok = rows < T
    col_ok = cols < E
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    logits = tl.where(col_ok[None, :], logits, float("-inf"))   # padding rows stay finite, columns out
    if SOFTMAX:
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(col_ok[None, :], choice, float("-inf"))
    if GROUPS > 1:
        choice = _open_groups_only(choice, cols, BT, E_P, GROUPS, TOPK_GROUPS, GROUP_SIZE, G_P)
    picks = tl.arange(0, K_P)
    weights = tl.zeros([BT, K_P], tl.float32)
    ids = tl.zeros([BT, K_P], tl.int32)
    for j in tl.static_range(K):
        best = tl.max(choice, axis=1)
        idx = tl.min(tl.where(choice == best[:, None], cols[None, :], E_P), axis=1)
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        weights = tl.where(picks[None, :] == j, w[:, None], weights)
        ids = tl.where(picks[None, :] == j, idx[:, None], ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    out = rows.to(tl.int64)[:, None] * (K + EXTRA) + picks[None, :]
    mask = row_ok[:, None] & (picks < K)[None, :]
    tl.store(w_ptr + out, weights * scale, mask=mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)
    if EXTRA:
        last = rows.to(tl.int64) * (K + 1) + K
        tl.store(w_ptr + last, tl.full([BT], 1.0, tl.float32), mask=row_ok)
        tl.store(ids_ptr + last, tl.full([BT], extra_id, tl.int64), mask=row_ok)


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def route_from_logits(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str,
                      renormalize: bool, scale: float, extra_expert: int | None = None, num_groups: int = 1,
                      topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, top_k] fp32, ids [T, top_k] int64); with `num_groups` > 1
    only experts of the `topk_groups` best groups; with `extra_expert`, [T, top_k + 1]: that expert
    last, weight 1."""
    interpreter_compat.install()
    T, E = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    width = top_k + (extra_expert is not None)
    weights = torch.empty(T, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, width, dtype=torch.int64, device=logits.device)
    if T:
        E_P = max(16, triton.next_power_of_2(E))
        # Rows per program: at most 4096 scores held at once, and ~128 programs or more where the
        # step has the rows (one row per program at decode sizes, 16 at prefill's thousands): a
        # decode step's routing is latency, spread over programs (docs/perf-notes.md).
        # Grouped routing holds the group scores too: 2048 scores (no spills on gfx942 at E = 512).
        held = 2048 if num_groups > 1 else 4096
        BT = max(1, min(16, held // E_P, _pow2_at_most(max(1, T // 128))))
        _route_kernel[(triton.cdiv(T, BT),)](
            logits, logits.stride(0), bias if bias is not None else logits, weights, ids, T, E, float(scale),
            extra_expert or 0, K=top_k, K_P=max(2, triton.next_power_of_2(top_k)), E_P=E_P, BT=BT,
            SOFTMAX=scoring == "softmax", HAS_BIAS=bias is not None, RENORMALIZE=renormalize,
            EXTRA=int(extra_expert is not None), GROUPS=num_groups, TOPK_GROUPS=topk_groups,
            GROUP_SIZE=E // num_groups, G_P=max(2, triton.next_power_of_2(num_groups)), num_warps=4,
        )
    return weights, ids
