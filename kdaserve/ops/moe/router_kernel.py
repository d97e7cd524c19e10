"""The router after its logits in one Triton launch: scores, the bias that only chooses, the top-k,
the chosen scores renormalized and scaled (the definition: router.route_tokens' torch path).

The torch path is ~8 kernels per MoE layer (sigmoid, the bias add, top-k, gather, sum, divide,
scale), each a launch and a gap in a CUDA graph at decode. One program routes
BT tokens; each holds its row of E scores and picks the k best by k rounds of (max, first index of
the max, mask it out), so the experts come in descending choice order as torch.topk gives them
(ties, which random fp32 scores do not make, go to the lower expert id). Routing restricted to
groups (num_groups > 1 with topk_groups < num_groups) is not done here: route_tokens keeps the
torch path for it.

With `extra_expert` every token also gets that expert with weight 1, as a last column: the shared
expert run by the fused experts' kernels as one more expert (layers/moe.py, at decode).

The logits before it: at decode sizes (at most LOGITS_KERNEL_MAX_TOKENS tokens) one launch that
reads the hidden states in their dtype and multiplies in fp32 (router_logit_parts), where the torch
path casts them to fp32 first (a launch of its own) and runs an fp32 GEMM; larger steps keep that.
That launch splits the hidden size into chunks of LOGITS_BK, one program per (chunk, BE experts,
16 tokens), and writes each chunk's partial logits; the routing kernel adds the parts up as it
loads them (in chunk order, so the sums do not depend on scheduling). Why split: the router's
weight is only E x hidden (2.4 MB fp32 at Kimi-Linear's shape), and one program per block of
experts looping over the hidden size made 16 programs, each a chain of dependent loads: on an H200
the logits and routing took 57 us in a CUDA graph, where routing alone took 14 and the bytes take
under 1 (bench_moe_mla's routing rows, docs/perf-notes.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat

LOGITS_KERNEL_MAX_TOKENS = 64
LOGITS_BK, LOGITS_BE = 128, 32   # hidden chunk and experts per program of the logits' parts


@triton.jit
def _router_logit_parts_kernel(x_ptr, stride_x, w_ptr, stride_w, parts_ptr, T, E, HIDDEN,
                               BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    """parts[c, t, e] = sum over k in chunk c of float(x[t, k]) * w[e, k] in fp32 (exact products,
    fp32 sums); one program per (BE experts, chunk c of BK, BT tokens): no loop, so each program's
    loads go out together. (Rows of 64 at once spill on sm_90; more rows re-read the weight tile
    from L2.)"""
    experts = tl.program_id(0) * BE + tl.arange(0, BE)
    c = tl.program_id(1)
    rows = tl.program_id(2) * BT + tl.arange(0, BT)
    ks = c * BK + tl.arange(0, BK)
    row_ok, e_ok, k_ok = rows < T, experts < E, ks < HIDDEN
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    w = tl.load(w_ptr + experts.to(tl.int64)[:, None] * stride_w + ks[None, :], mask=e_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    acc = tl.dot(x, tl.trans(w), input_precision="ieee")
    out = parts_ptr + (c * T).to(tl.int64) * E + rows.to(tl.int64)[:, None] * E + experts[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & e_ok[None, :])


def router_logit_parts(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] (any float dtype, T <= LOGITS_KERNEL_MAX_TOKENS) and gate_weight [E, hidden] ->
    parts [cdiv(hidden, LOGITS_BK), T, E] fp32 whose sum over the first dim is
    F.linear(x.float(), gate_weight.float()) up to the order of the fp32 sums (route_from_logits
    takes them as they are)."""
    interpreter_compat.install()
    T, hidden = x.shape
    E = gate_weight.shape[0]
    if gate_weight.shape[1] != hidden:
        raise ValueError(f"router weight must be [E, {hidden}] for hidden states [T, {hidden}], got "
                         f"{list(gate_weight.shape)}")
    if T > LOGITS_KERNEL_MAX_TOKENS:
        raise ValueError(f"the router logits kernel takes at most {LOGITS_KERNEL_MAX_TOKENS} tokens, got {T}; "
                         "larger steps use F.linear of the fp32 cast")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    chunks = triton.cdiv(hidden, LOGITS_BK)
    parts = torch.empty(chunks, T, E, dtype=torch.float32, device=x.device)
    if T:
        _router_logit_parts_kernel[(triton.cdiv(E, LOGITS_BE), chunks, triton.cdiv(T, 16))](
            x, x.stride(0), w, w.stride(0), parts, T, E, hidden, BT=16, BE=LOGITS_BE, BK=LOGITS_BK, num_warps=4)
    return parts


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] @ gate_weight [E, hidden]^T -> [T, E] fp32 through router_logit_parts (the
    parts summed here; routing takes the parts and sums them in its own kernel)."""
    return router_logit_parts(x, gate_weight).sum(0)


@triton.jit
def _route_kernel(
    logits_ptr, stride_l, stride_part, bias_ptr, w_ptr, ids_ptr, T, E, scale, extra_id,
    K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr, BT: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, EXTRA: tl.constexpr = 0,
    PARTS: tl.constexpr = 1,
):
    """EXTRA (0 or 1): a last column of expert `extra_id` with weight 1 (rows of K + EXTRA). PARTS:
    the logits come as that many parts `stride_part` apart, added in order (unrolled, so their
    loads go out together)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, E_P)
    row_ok = rows < T
    col_ok = cols < E
    at = logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :]
    in_row = row_ok[:, None] & col_ok[None, :]
    logits = tl.load(at, mask=in_row, other=0.0)
    for p in tl.static_range(1, PARTS):
        logits += tl.load(at + p * stride_part, mask=in_row, other=0.0)
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


def route_from_logits(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str,
                      renormalize: bool, scale: float, extra_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, or their parts [P, T, E] (router_logit_parts: added up here) ->
    (weights [T, top_k] fp32, ids [T, top_k] int64), ungrouped routing; with `extra_expert`,
    [T, top_k + 1]: that expert last, weight 1."""
    interpreter_compat.install()
    parts = logits if logits.dim() == 3 else logits.unsqueeze(0)
    parts = parts if parts.stride(2) == 1 else parts.contiguous()
    P, T, E = parts.shape
    width = top_k + (extra_expert is not None)
    weights = torch.empty(T, width, dtype=torch.float32, device=parts.device)
    ids = torch.empty(T, width, dtype=torch.int64, device=parts.device)
    if T:
        E_P = max(16, triton.next_power_of_2(E))
        # Rows per program: up to 4096 scores held at once, no more rows than the step has (a
        # decode step of one token reduces one row, not 16), and one row where P parts are loaded.
        held = max(1, 4096 // (E_P * P))
        BT = min(16, 1 << (held.bit_length() - 1), triton.next_power_of_2(T))   # powers of two
        _route_kernel[(triton.cdiv(T, BT),)](
            parts, parts.stride(1), parts.stride(0), bias if bias is not None else parts, weights, ids, T, E,
            float(scale), extra_expert or 0, K=top_k, K_P=max(2, triton.next_power_of_2(top_k)), E_P=E_P, BT=BT,
            SOFTMAX=scoring == "softmax", HAS_BIAS=bias is not None, RENORMALIZE=renormalize,
            EXTRA=int(extra_expert is not None), PARTS=P, num_warps=4,
        )
    return weights, ids
