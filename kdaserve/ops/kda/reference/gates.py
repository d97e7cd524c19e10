"""Elementwise pieces of KDA: l2norm (scale folded into q), the forget gate, beta."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdaserve.ops.kda.limits import check_lower_bound


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 when any input is fp64 (ground truth), else fp32: gates and norms never run in 16 bits."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along the last dim (eps inside the square root), in fp32/fp64."""
    x = x.to(compute_dtype(x))
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's q/k normalization: both l2-normalized, q also scaled by D^-0.5."""
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def kda_gate(
    forget_logits: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
    gate_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-channel log-decay gk [T, H, D] from forget-gate logits forget_logits [T, H, D].

    bounded:   gk = LB * sigmoid(exp(A_log[h]) * (forget_logits + dt_bias[h]))   (LB = lower_bound in [-5, 0))
    unbounded: gk = -exp(A_log[h]) * softplus(forget_logits + dt_bias[h])        (lower_bound is None)

    `gate_dtype`: gk rounded to it (Ling-3's cast to the activation dtype), then used in the
    compute dtype as before.
    """
    dt = compute_dtype(forget_logits, dt_bias)
    x = forget_logits.to(dt) + dt_bias.to(dt)
    a = A_log.to(dt).exp().view(-1, 1)
    if lower_bound is None:
        gk = -a * F.softplus(x, beta=1.0, threshold=20.0)
    else:
        check_lower_bound(lower_bound)
        gk = lower_bound * torch.sigmoid(a * x)
    return gk if gate_dtype is None else gk.to(gate_dtype).to(dt)


def beta_sigmoid(b: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(b.to(compute_dtype(b)))
