"""The mHC math in plain torch (layers/hyper_connection.py states it): the definition the kernels
meet. Everything but the collapse and the update runs in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hc_pre_reference(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                     iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, D] -> (post [T, N] fp32, comb [T, N, N] fp32, the sublayer input [T, D])."""
    T, N = streams.shape[0], streams.shape[1]
    x = streams.reshape(T, -1).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    w = F.linear(x, fn.float())
    pre_w, post_w, comb_w = w.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = base.float().split([N, N, N * N])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(T, N, N) * scale[2] + comb_b.view(N, N), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_post_reference(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """S' [T, N, D] = post[n] * out + sum_m comb[m, n] S[m], in the streams' dtype (as transformers)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
