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
Reference in plain torch, two Triton kernels per sublayer on a GPU (ops/hyper_connection/).
Released names: `hc_attn_fn` / `hc_attn_base` / `hc_attn_scale` and `hc_ffn_*`, kept in fp32 as
they are used."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.layers.kernel_choice import resolve_kernel_choice
from kdaserve.ops.hyper_connection.reference import hc_post_reference, hc_pre_reference


class HyperConnection(nn.Module):
    def __init__(self, hidden_size: int, hc_mult: int, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 backend: str = "auto", device=None):
        super().__init__()
        device = torch.device(device) if device is not None else torch.empty(0).device
        self.N, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult
        f32 = dict(dtype=torch.float32, device=device)
        self.fn = nn.Parameter(torch.zeros(width, hc_mult * hidden_size, **f32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(width, **f32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, **f32), requires_grad=False)
        # The two Triton kernels (ops/hyper_connection/triton_hc.py) need a power-of-two stream count.
        self.backend = resolve_kernel_choice("mHC", backend, device)
        if self.backend == "triton" and hc_mult & (hc_mult - 1):
            raise ValueError(f"mHC backend 'triton' needs a power-of-two hc_mult, got {hc_mult}; use 'reference'")

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N] fp32, comb [T, N, N] fp32, the sublayer input [T, D])."""
        kw = dict(iters=self.iters, hc_eps=self.hc_eps, norm_eps=self.norm_eps)
        if self.backend == "triton":
            from kdaserve.ops.hyper_connection.triton_hc import hc_pre_triton

            return hc_pre_triton(streams, self.fn, self.base, self.scale, **kw)
        return hc_pre_reference(streams, self.fn, self.base, self.scale, **kw)

    def update(self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """S' [T, N, D] = post[n] * out + sum_m comb[m, n] S[m] (in the streams' dtype)."""
        if self.backend == "triton":
            from kdaserve.ops.hyper_connection.triton_hc import hc_post_triton

            return hc_post_triton(streams, out, post, comb)
        return hc_post_reference(streams, out, post, comb)

    def extra_repr(self) -> str:
        return f"streams={self.N}, sinkhorn_iters={self.iters}, backend={self.backend}"
