"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder layer.

The torch path below is the definition; on a GPU (`auto`) one Triton kernel does the add and the
norm in one pass over the rows (ops/norm/rms_norm.py)."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.layers.kernel_choice import per_call_choice, takes_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, *, dtype: torch.dtype | None = None, device=None,
                 backend: str = "auto"):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.backend = per_call_choice("RMSNorm", backend, self.weight.device)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the new residual
        stream kept in x's dtype, as the next layer's pre-norm needs both."""
        if takes_triton(self.backend, x):
            from kdaserve.ops.norm.rms_norm import rms_norm_fwd

            return rms_norm_fwd(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual = (x.float() + residual.float()).to(x.dtype)
        return self._norm(residual), residual
