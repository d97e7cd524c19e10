"""mHC in two launches per sublayer instead of ~50 small ops (twenty Sinkhorn iterations alone are
forty): the weights' GEMM is torch's (x @ fn^T on the raw streams: the RMS factor is a per-token
scalar, applied after), then

- `hc_pre`: one program per token reads its streams twice (the sum of squares, then the collapse
  with `pre`), and computes pre / post / comb with the Sinkhorn iterations in registers (an N x N
  tile); writes post [T, N], comb [T, N, N] (fp32) and the sublayer input [T, D].
- `hc_post`: one program per (token, block of D) forms S' = post * out + comb^T S for all N
  streams of that block in one pass.

fp32 math throughout; outputs in the streams' dtype. The update differs from the torch form only
in rounding: torch rounds comb and post to the streams' dtype first (bf16), the kernel does not."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops import interpreter_compat


@triton.jit
def hc_pre_kernel(s_ptr, raw_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, x_ptr,
                  D, hc_eps, norm_eps,
                  N: tl.constexpr, ITERS: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + t * N * D
    n_idx = tl.arange(0, N)
    d_idx = tl.arange(0, BD)
    ss = tl.zeros((N, BD), dtype=tl.float32)
    for d0 in range(0, D, BD):
        m = (d0 + d_idx) < D
        v = tl.load(s_row + n_idx[:, None] * D + (d0 + d_idx)[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        ss += v * v
    r = tl.rsqrt(tl.sum(tl.sum(ss, axis=1), axis=0) / (N * D) + norm_eps)
    W: tl.constexpr = (2 + N) * N
    raw = raw_ptr + t * W
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.load(raw + n_idx) * r * s0 + tl.load(base_ptr + n_idx)) + hc_eps
    post = 2.0 * tl.sigmoid(tl.load(raw + N + n_idx) * r * s1 + tl.load(base_ptr + N + n_idx))
    cell = n_idx[:, None] * N + n_idx[None, :]
    logits = tl.load(raw + 2 * N + cell) * r * s2 + tl.load(base_ptr + 2 * N + cell)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + t * N + n_idx, post)
    tl.store(comb_ptr + t * N * N + cell, comb)
    for d0 in range(0, D, BD):
        m = (d0 + d_idx) < D
        v = tl.load(s_row + n_idx[:, None] * D + (d0 + d_idx)[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        x = tl.sum(pre[:, None] * v, axis=0)
        tl.store(x_ptr + t * D + d0 + d_idx, x.to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def hc_post_kernel(s_ptr, out_ptr, post_ptr, comb_ptr, y_ptr, D,
                   N: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    m = d < D
    n_idx = tl.arange(0, N)
    s = tl.load(s_ptr + t * N * D + n_idx[:, None] * D + d[None, :], mask=m[None, :], other=0.0).to(tl.float32)
    o = tl.load(out_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + n_idx)
    comb = tl.load(comb_ptr + t * N * N + n_idx[:, None] * N + n_idx[None, :])     # [m, n]
    mixed = tl.sum(comb[:, :, None] * s[:, None, :], axis=0)                         # [n, BD]
    y = post[:, None] * o[None, :] + mixed
    tl.store(y_ptr + t * N * D + n_idx[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=m[None, :])


def _check_streams(streams: torch.Tensor) -> None:
    if streams.dim() != 3 or not streams.is_contiguous():
        raise ValueError(f"streams must be a contiguous [T, N, D] tensor, got {list(streams.shape)} "
                         f"(contiguous: {streams.is_contiguous()})")
    N = streams.shape[1]
    if N & (N - 1):
        raise ValueError(f"the Triton mHC kernels need a power-of-two number of streams (hc_mult), got {N}; "
                         f"use the reference path")


def hc_pre_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                  iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_streams(streams)
    interpreter_compat.install()   # loops over a runtime D under the CPU interpreter
    T, N, D = streams.shape
    raw = torch.matmul(streams.reshape(T, N * D).float(), fn.float().t())   # [T, (2+N)N]; the RMS factor comes later
    post = torch.empty(T, N, dtype=torch.float32, device=streams.device)
    comb = torch.empty(T, N, N, dtype=torch.float32, device=streams.device)
    x = torch.empty(T, D, dtype=streams.dtype, device=streams.device)
    if T:
        hc_pre_kernel[(T,)](streams, raw, base.float().contiguous(), scale.float().contiguous(), post, comb, x,
                            D, hc_eps, norm_eps, N=N, ITERS=iters, BD=min(1024, triton.next_power_of_2(D)))
    return post, comb, x


def hc_post_triton(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    _check_streams(streams)
    T, N, D = streams.shape
    out = out.contiguous()
    y = torch.empty_like(streams)
    BD = min(256, triton.next_power_of_2(D))
    if T:
        hc_post_kernel[(T, triton.cdiv(D, BD))](streams, out, post.contiguous(), comb.contiguous(), y, D, N=N, BD=BD)
    return y
