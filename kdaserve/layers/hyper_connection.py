"""Manifold-constrained hyper-connections (mHC, GLM-5.3-Flash): `hc_mult` = N residual streams
instead of one. Per sublayer (attention, then the MLP), from the streams S [T, N, D]:

    x      = rmsnorm(flatten(S))                    unweighted, fp32           [T, N*D]
    w      = x @ fn^T                               fn [(2+N)N, N*D], fp32     [T, (2+N)N]
    pre    = sigmoid(w_pre * scale0 + base_pre) + eps                          [T, N]
    post   = 2 sigmoid(w_post * scale1 + base_post)                            [T, N]
    comb   = softmax(w_comb * scale2 + base_comb, rows) + eps, then Sinkhorn:  [T, N, N]
             columns normalised once, then (rows, columns) iters - 1 times
    input  = sum_n pre[n] S[n]                      the sublayer's input       [T, D]
    S'     = post[n] * sublayer(norm(input)) + sum_m comb[m, n] S[m]

The embedding enters replicated into all N streams; the output is the final norm of their mean.
Plain torch (CPU and GPU). Released names: `hc_attn_fn` / `hc_attn_base` / `hc_attn_scale` and
`hc_ffn_*`, kept in fp32 as they are used."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class HyperConnection(nn.Module):
    def __init__(self, hidden_size: int, hc_mult: int, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 device=None):
        super().__init__()
        self.N, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult
        f32 = dict(dtype=torch.float32, device=device)
        self.fn = nn.Parameter(torch.zeros(width, hc_mult * hidden_size, **f32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(width, **f32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, **f32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N] fp32, comb [T, N, N] fp32, the sublayer input [T, D])."""
        T, N = streams.shape[0], self.N
        x = streams.reshape(T, -1).float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)
        w = F.linear(x, self.fn)
        pre_w, post_w, comb_w = w.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.split([N, N, N * N])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(T, N, N) * self.scale[2] + comb_b.view(N, N), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def update(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """S' [T, N, D] = post[n] * out + sum_m comb[m, n] S[m] (in the streams' dtype)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)

    def extra_repr(self) -> str:
        return f"streams={self.N}, sinkhorn_iters={self.iters}"
