"""A mixture-of-experts MLP: router, routed experts stacked for the grouped GEMM, shared experts.

Released checkpoints store each expert apart (Kimi-Linear: `experts.{e}.w1/w3/w2.weight`); they
are written at load time into `w13 [E, 2I, hidden]` (w1 = gate rows, then w3 = up rows) and
`w2 [E, hidden, I]`, so the fused path reads one tensor per projection. The router's weight and
correction bias are kept in fp32, as the released checkpoints ship them and as they are used."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.layers.kernel_choice import resolve_kernel_choice
from kdaserve.layers.mlp import SwiGLUMLP
from kdaserve.ops.moe.reference import moe_experts_reference
from kdaserve.ops.moe.router import RouterConfig, route_tokens


class MoEMLP(nn.Module):
    def __init__(self, hidden_size: int, router: RouterConfig, expert_intermediate_size: int, *,
                 num_shared_experts: int = 0, has_correction_bias: bool = True, activation_limit: float | None = None,
                 backend: str = "auto", dtype=None, device=None):
        super().__init__()
        device = torch.device(device) if device is not None else torch.empty(0).device
        E, I = router.num_experts, expert_intermediate_size
        self.router, self.hidden_size, self.intermediate_size = router, hidden_size, I
        self.activation_limit = activation_limit
        f32 = dict(dtype=torch.float32, device=device)
        self.gate_weight = nn.Parameter(torch.zeros(E, hidden_size, **f32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(E, **f32), requires_grad=False)
                                        if has_correction_bias else None)
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, hidden_size, I, dtype=dtype, device=device), requires_grad=False)
        self.shared_experts = (SwiGLUMLP(hidden_size, I * num_shared_experts, activation_limit=activation_limit,
                                         dtype=dtype, device=device)
                               if num_shared_experts else None)
        self.backend = resolve_kernel_choice("MoE", backend, device)

    def load_expert(self, expert: int, which: str, tensor: torch.Tensor) -> None:
        """One released expert tensor: which = w1 (gate), w3 (up) or w2 (down)."""
        E, I, h = self.router.num_experts, self.intermediate_size, self.hidden_size
        if not 0 <= expert < E:
            raise ValueError(f"expert index {expert} out of range: the model has {E} routed experts")
        want = (h, I) if which == "w2" else (I, h)
        if tuple(tensor.shape) != want:
            raise ValueError(f"expert {expert} {which}.weight must be {list(want)}, got {list(tensor.shape)}")
        target = {"w1": self.w13[expert, :I], "w3": self.w13[expert, I:], "w2": self.w2[expert]}[which]
        target.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_tokens(x, self.gate_weight, self.e_score_correction_bias, self.router)
        if self.backend == "triton":
            from kdaserve.ops.moe.fused import moe_experts_fused

            out = moe_experts_fused(x, self.w13, self.w2, weights, ids, self.activation_limit)
        else:
            out = moe_experts_reference(x, self.w13, self.w2, weights, ids, self.activation_limit)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def extra_repr(self) -> str:
        r = self.router
        return (f"experts={r.num_experts} (top {r.top_k}, {r.scoring}, groups {r.topk_groups}/{r.num_groups}, "
                f"scale {r.routed_scaling_factor}), width={self.intermediate_size}, backend={self.backend}")
