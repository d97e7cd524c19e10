"""A mixture-of-experts MLP: router, routed experts stacked for the grouped GEMM, shared experts.

Released checkpoints store each expert apart (Kimi-Linear: `experts.{e}.w1/w3/w2.weight`); they
are written at load time into `w13 [E, 2I, hidden]` (w1 = gate rows, then w3 = up rows) and
`w2 [E, hidden, I]`, so the fused path reads one tensor per projection. The router's weight and
correction bias are kept in fp32, as the released checkpoints ship them and as they are used."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.layers.distributed import all_reduce, local_slice, split, tensor_parallel
from kdaserve.layers.kernel_choice import resolve_kernel_choice
from kdaserve.layers.mlp import SwiGLUMLP
from kdaserve.ops.fp8.reference import FP8
from kdaserve.ops.moe.reference import moe_experts_fp8_reference, moe_experts_reference
from kdaserve.ops.moe.router import RouterConfig, route_tokens

# Steps of at most this many tokens (decode) run a shared expert of the routed experts' width as
# one more expert inside the fused kernels: three launches fewer per MoE layer (its two GEMMs and
# its SwiGLU), where a decode step is launch-bound. Larger steps keep it apart, in cuBLAS's GEMMs,
# which run a dense [T, hidden] x [hidden, 2I] faster than the grouped kernel does.
SHARED_AS_EXPERT_MAX_TOKENS = 64


class MoEMLP(nn.Module):
    def __init__(self, hidden_size: int, router: RouterConfig, expert_intermediate_size: int, *,
                 num_shared_experts: int = 0, has_correction_bias: bool = True, activation_limit: float | None = None,
                 backend: str = "auto", dtype=None, device=None, fp8_block: tuple[int, int] | None = None,
                 shared_fp8_block: tuple[int, int] | None = None):
        super().__init__()
        device = torch.device(device) if device is not None else torch.empty(0).device
        # Tensor parallel: every expert's width split over the ranks (gate|up by rows, down by
        # columns), the router whole; the routed and shared experts' partial sums added once.
        E, I = router.num_experts, split(expert_intermediate_size, "moe_intermediate_size")
        self.tp = tensor_parallel()
        self.router, self.hidden_size, self.intermediate_size = router, hidden_size, I
        self.activation_limit = activation_limit
        f32 = dict(dtype=torch.float32, device=device)
        self.gate_weight = nn.Parameter(torch.zeros(E, hidden_size, **f32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(E, **f32), requires_grad=False)
                                        if has_correction_bias else None)
        self.fp8_block = fp8_block
        wdt = FP8 if fp8_block is not None else dtype
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, hidden_size, dtype=wdt, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, hidden_size, I, dtype=wdt, device=device), requires_grad=False)
        if fp8_block is not None:   # one scale per block of each expert's gate|up and down weights
            br, bc = fp8_block
            if I % br:
                raise ValueError(f"FP8 experts need the expert width ({I}) to be a multiple of the {br}-row block")
            self.w13_scale_inv = nn.Parameter(torch.empty(E, 2 * I // br, -(-hidden_size // bc), **f32), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(E, -(-hidden_size // br), -(-I // bc), **f32), requires_grad=False)
        self.backend = resolve_kernel_choice("MoE", backend, device)
        # The shared experts' SwiGLU follows the routed experts' backend (reference: torch throughout).
        self.shared_experts = (SwiGLUMLP(hidden_size, expert_intermediate_size * num_shared_experts,
                                         activation_limit=activation_limit, dtype=dtype, device=device,
                                         fp8_block=shared_fp8_block, backend=self.backend, reduce_output=False)
                               if num_shared_experts else None)

    def load_expert(self, expert: int, which: str, tensor: torch.Tensor, scale: bool = False) -> None:
        """One released expert tensor: which = w1 (gate), w3 (up) or w2 (down); `scale`: its
        weight_scale_inv (FP8 experts)."""
        E, I = self.router.num_experts, self.intermediate_size
        if not 0 <= expert < E:
            raise ValueError(f"expert index {expert} out of range: the model has {E} routed experts")
        if scale:
            if self.fp8_block is None:
                raise ValueError(f"expert {expert} {which}.weight_scale_inv: these experts are not FP8, so the scale must be "
                                 f"applied at load (models/fp8.dequantized_weights) or the experts built with fp8_block")
            Ib = I // self.fp8_block[0]
            w13, w2 = self.w13_scale_inv, self.w2_scale_inv
            target = {"w1": w13[expert, :Ib], "w3": w13[expert, Ib:], "w2": w2[expert]}[which]
        else:
            w13, w2 = self.w13, self.w2
            target = {"w1": w13[expert, :I], "w3": w13[expert, I:], "w2": w2[expert]}[which]
        tensor = local_slice(tensor, target.shape)   # this rank's part of the expert's width
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert} {which}.weight{'_scale_inv' if scale else ''} must be {list(target.shape)}, "
                             f"got {list(tensor.shape)}")
        if target.dtype == FP8 and tensor.dtype != FP8:
            raise ValueError(f"expert {expert} {which}.weight arrived as {tensor.dtype}; FP8 experts take it quantized")
        target.copy_(tensor)

    def shared_as_expert(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared expert's (gate|up, down) weights where the fused kernels run it as expert E:
        one shared expert of the routed width in the routed dtype, the routing kernel (it appends
        the column), a decode-sized step."""
        s = self.shared_experts
        if (s is None or self.backend != "triton" or num_tokens > SHARED_AS_EXPERT_MAX_TOKENS
                or self.fp8_block is not None or s.activation_limit != self.activation_limit):
            return None
        w13, w2 = getattr(s.gate_up_proj, "weight", None), getattr(s.down_proj, "weight", None)
        if (w13 is None or w2 is None or w13.dtype != self.w13.dtype or tuple(w13.shape) != tuple(self.w13.shape[1:])
                or tuple(w2.shape) != tuple(self.w2.shape[1:]) or s.gate_up_proj.bias is not None
                or not (w13.is_contiguous() and w2.is_contiguous() and self.w13.is_contiguous() and self.w2.is_contiguous())):
            return None
        return w13, w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self._experts(x), self.tp)   # the ranks' partial sums (tensor parallel)

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        shared_expert = self.shared_as_expert(x.shape[0])
        # Routing follows the experts' backend: the reference routes in torch; the Triton backend in
        # the routing kernel (grouped or not), on a GPU or in the interpreter.
        weights, ids = route_tokens(x, self.gate_weight, self.e_score_correction_bias, self.router,
                                    use_kernel=self.backend == "triton",
                                    extra_expert=self.router.num_experts if shared_expert is not None else None)
        if self.backend == "triton":
            from kdaserve.ops.moe.fused import moe_experts_fused

            if shared_expert is not None:
                return moe_experts_fused(x, self.w13, self.w2, weights, ids, self.activation_limit, shared=shared_expert)
            # The shared experts first: the routed experts' final sum adds their output (one launch less).
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            fp8 = {} if self.fp8_block is None else dict(w13_scale=self.w13_scale_inv, w2_scale=self.w2_scale_inv,
                                                         block=self.fp8_block)
            return moe_experts_fused(x, self.w13, self.w2, weights, ids, self.activation_limit, addend=shared, **fp8)
        if self.fp8_block is not None:
            out = moe_experts_fp8_reference(x, self.w13, self.w2, weights, ids, self.activation_limit, self.w13_scale_inv,
                                            self.w2_scale_inv, self.fp8_block)
        else:
            out = moe_experts_reference(x, self.w13, self.w2, weights, ids, self.activation_limit)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def extra_repr(self) -> str:
        r = self.router
        return (f"experts={r.num_experts} (top {r.top_k}, {r.scoring}, groups {r.topk_groups}/{r.num_groups}, "
                f"scale {r.routed_scaling_factor}), width={self.intermediate_size}, backend={self.backend}"
                + (f", fp8 blocks={self.fp8_block}" if self.fp8_block else ""))
