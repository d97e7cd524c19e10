"""Mixture-of-experts kernels: the router (sigmoid or softmax scores, correction bias, grouped
top-k, renormalisation, scaling), the torch reference of the expert computation, and the Triton
fused path (tokens grouped by expert, one grouped GEMM per projection, SiLU-gated).

Experts are stacked at load time: `w13 [E, 2I, hidden]` (gate rows, then up rows) and
`w2 [E, hidden, I]`."""

from kdaserve.ops.moe.reference import moe_experts_reference
from kdaserve.ops.moe.router import RouterConfig, route_tokens

__all__ = ["RouterConfig", "moe_experts_reference", "route_tokens"]
