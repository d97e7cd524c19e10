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
from kdaserve.layers.linear import fp4_weights_of
from kdaserve.layers.mlp import SwiGLUMLP
from kdaserve.ops.fp4.reference import NV_GROUP
from kdaserve.ops.fp4.weights import SCHEME_GROUP, Fp4Weights, scale_storage
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
                 shared_fp8_block: tuple[int, int] | None = None, fp4: str | None = None, shared_fp4: str | None = None):
        """`fp4` ("mxfp4" / "nvfp4"): the routed experts kept in 4 bits (ops/fp4/weights.py's form:
        packed codes, uint8 group scales and, for NVFP4, a divisor per row), decoded inside the
        fused kernels; the reference path dequantizes them (the definition). `shared_fp4`: the shared
        experts' linears in 4 bits (layers/linear.Fp4Linear)."""
        super().__init__()
        device = torch.device(device) if device is not None else torch.empty(0).device
        # Tensor parallel: every expert's width split over the ranks (gate|up by rows, down by
        # columns), or with expert parallelism whole experts per rank (E / N of them, from
        # `expert_offset`); the router whole, the shared experts' width split either way; the
        # routed and shared experts' partial sums added once.
        self.tp = tp = tensor_parallel()
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        if self.expert_parallel:
            E, I = split(router.num_experts, "the routed experts (--enable-expert-parallel)"), expert_intermediate_size
            self.expert_offset = tp.rank * E
        else:
            E, I = router.num_experts, split(expert_intermediate_size, "moe_intermediate_size")
            self.expert_offset = 0
        self.router, self.hidden_size, self.intermediate_size = router, hidden_size, I
        self.activation_limit = activation_limit
        f32 = dict(dtype=torch.float32, device=device)
        self.gate_weight = nn.Parameter(torch.zeros(router.num_experts, hidden_size, **f32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(router.num_experts, **f32), requires_grad=False)
                                        if has_correction_bias else None)
        self.num_local_experts = E
        self.fp8_block, self.fp4_group = fp8_block, SCHEME_GROUP[fp4] if fp4 else None
        if fp4:
            self._make_fp4_experts(E, I, hidden_size, device)
        else:
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
                                         fp8_block=shared_fp8_block, backend=self.backend, reduce_output=False,
                                         fp4=shared_fp4)
                               if num_shared_experts else None)

    def _make_fp4_experts(self, E: int, I: int, hidden: int, device) -> None:
        group = self.fp4_group
        if I % group or hidden % group:
            raise ValueError(f"4-bit experts in groups of {group} need the expert width ({I} on this rank) and the hidden "
                             f"size ({hidden}) to be multiples of {group}")

        def param(*shape, dtype=torch.uint8):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        def scales(*shape):   # rows 16 bytes apart (ops/fp4/weights.scale_storage)
            return nn.Parameter(scale_storage(*shape, device=device), requires_grad=False)

        self.w13, self.w13_scale = param(E, 2 * I, hidden // 2), scales(E, 2 * I, hidden // group)
        self.w2, self.w2_scale = param(E, hidden, I // 2), scales(E, hidden, I // group)
        if group == NV_GROUP:
            self.w13_divisor, self.w2_divisor = param(E, 2 * I, dtype=torch.float32), param(E, hidden, dtype=torch.float32)

    def experts(self) -> tuple:
        """(w13, w2) as the expert kernels take them: tensors, or the 4-bit form."""
        if self.fp4_group is None:
            return self.w13, self.w2
        nv = self.fp4_group == NV_GROUP
        return (Fp4Weights(self.w13, self.w13_scale, self.w13_divisor if nv else None, self.fp4_group),
                Fp4Weights(self.w2, self.w2_scale, self.w2_divisor if nv else None, self.fp4_group))

    def load_expert(self, expert: int, which: str, tensor: torch.Tensor, piece: str = "weight") -> None:
        """One released expert tensor: which = w1 (gate), w3 (up) or w2 (down); `piece`: weight, or
        weight_scale_inv (FP8 experts), or weight_scale / weight_global_scale (4-bit experts, in
        ops/fp4/weights.py's form: the scale as uint8 codes, the global scale one value)."""
        E, I = self.router.num_experts, self.intermediate_size
        if not 0 <= expert < E:
            raise ValueError(f"expert index {expert} out of range: the model has {E} routed experts")
        local = expert - self.expert_offset
        if not 0 <= local < self.num_local_experts:   # expert parallel: another rank's expert (never read)
            return
        if piece != "weight_scale_inv" and (self.fp4_group is not None or piece != "weight"):
            self._load_fp4_piece(expert, local, which, tensor, piece)
            return
        if piece == "weight_scale_inv":
            if self.fp8_block is None:
                raise ValueError(f"expert {expert} {which}.weight_scale_inv: these experts are not FP8, so the scale must be "
                                 f"applied at load (models/fp8.dequantized_weights) or the experts built with fp8_block")
            Ib = I // self.fp8_block[0]
            w13, w2 = self.w13_scale_inv, self.w2_scale_inv
            target = {"w1": w13[local, :Ib], "w3": w13[local, Ib:], "w2": w2[local]}[which]
        else:
            w13, w2 = self.w13, self.w2
            target = {"w1": w13[local, :I], "w3": w13[local, I:], "w2": w2[local]}[which]
        tensor = local_slice(tensor, target.shape)   # this rank's part of the expert's width
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert} {which}.{piece} must be {list(target.shape)}, got {list(tensor.shape)}")
        if target.dtype == FP8 and tensor.dtype != FP8:
            raise ValueError(f"expert {expert} {which}.weight arrived as {tensor.dtype}; FP8 experts take it quantized")
        target.copy_(tensor)

    def _load_fp4_piece(self, expert: int, local: int, which: str, tensor: torch.Tensor, piece: str) -> None:
        if self.fp4_group is None:
            raise ValueError(f"expert {expert} {which}.{piece}: these experts are not 4-bit (a 4-bit checkpoint's experts "
                             f"are kept in 4 bits only where every expert of the layer is; else models/fp4.py dequantizes)")
        I, nv = self.intermediate_size, self.fp4_group == NV_GROUP
        rows = {"w1": slice(0, I), "w3": slice(I, 2 * I), "w2": slice(None)}[which]
        stack = {"weight": "", "weight_scale": "_scale", "weight_global_scale": "_divisor"}.get(piece)
        if stack is None or (stack == "_divisor" and not nv):
            raise ValueError(f"expert {expert} {which}.{piece}: {'NV' if nv else 'MX'}FP4 experts take weight, weight_scale"
                             f"{' and weight_global_scale' if nv else ''}")
        target = getattr(self, ("w2" if which == "w2" else "w13") + stack)[local, rows]
        if stack == "_divisor":   # one value for the whole tensor: every row of this projection divides by it
            if tensor.numel() != 1:
                raise ValueError(f"expert {expert} {which}.weight_global_scale must be one value, got {list(tensor.shape)}")
            target.copy_(tensor.reshape(()).float().expand(target.shape))
            return
        if tensor.dtype == torch.float8_e4m3fn and stack == "_scale":   # NVFP4's scales, kept as their bits
            tensor = tensor.view(torch.uint8)
        if tensor.dtype != torch.uint8:
            raise ValueError(f"expert {expert} {which}.{piece} arrived as {tensor.dtype}; 4-bit experts take packed uint8 "
                             f"codes and uint8 / e4m3 scales")
        tensor = local_slice(tensor, target.shape)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert} {which}.{piece} must be {list(target.shape)}, got {list(tensor.shape)}")
        target.copy_(tensor)

    def shared_as_expert(self, num_tokens: int) -> tuple | None:
        """The shared expert's (gate|up, down) weights where the fused kernels run it as expert E:
        one shared expert of the routed width in the routed dtype (or the routed experts' 4-bit
        form), the routing kernel (it appends the column), a decode-sized step."""
        s = self.shared_experts
        if (s is None or self.backend != "triton" or num_tokens > SHARED_AS_EXPERT_MAX_TOKENS or self.expert_parallel
                or self.fp8_block is not None or s.activation_limit != self.activation_limit):
            return None
        if self.fp4_group is not None:
            return self._fp4_shared_as_expert()
        w13, w2 = getattr(s.gate_up_proj, "weight", None), getattr(s.down_proj, "weight", None)
        if (w13 is None or w2 is None or w13.dtype != self.w13.dtype or tuple(w13.shape) != tuple(self.w13.shape[1:])
                or tuple(w2.shape) != tuple(self.w2.shape[1:]) or s.gate_up_proj.bias is not None
                or not (w13.is_contiguous() and w2.is_contiguous() and self.w13.is_contiguous() and self.w2.is_contiguous())):
            return None
        return w13, w2

    def _fp4_shared_as_expert(self) -> tuple[Fp4Weights, Fp4Weights] | None:
        """A shared expert in the routed experts' 4-bit form, width and row strides, or None."""
        from kdaserve.ops.moe.fused import fp4_shared_expert_fits

        s = self.shared_experts
        if any(getattr(proj, "fp4_group", None) != self.fp4_group for proj in (s.gate_up_proj, s.down_proj)):
            return None
        shared = (fp4_weights_of(s.gate_up_proj), fp4_weights_of(s.down_proj))
        return shared if fp4_shared_expert_fits(shared, *self.experts()) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self._experts(x), self.tp)   # the ranks' partial sums (tensor parallel)

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        shared_expert = self.shared_as_expert(x.shape[0])
        # Routing follows the experts' backend: the reference routes in torch; the Triton backend in
        # the routing kernel (grouped or not), on a GPU or in the interpreter.
        weights, ids = route_tokens(x, self.gate_weight, self.e_score_correction_bias, self.router,
                                    use_kernel=self.backend == "triton",
                                    extra_expert=self.router.num_experts if shared_expert is not None else None)
        w13, w2 = self.experts()
        if self.expert_parallel:   # other ranks' experts become the skipped expert E_local, weight 0
            local = ids - self.expert_offset
            mine = (local >= 0) & (local < self.num_local_experts)
            ids = torch.where(mine, local, self.num_local_experts)
            weights = torch.where(mine, weights, 0.0)
        skip = dict(skip_expert=True) if self.expert_parallel else {}
        if self.backend == "triton":
            from kdaserve.ops.moe.fused import moe_experts_fused

            if shared_expert is not None:
                return moe_experts_fused(x, w13, w2, weights, ids, self.activation_limit, shared=shared_expert)
            # The shared experts first: the routed experts' final sum adds their output (one launch less).
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            fp8 = {} if self.fp8_block is None else dict(w13_scale=self.w13_scale_inv, w2_scale=self.w2_scale_inv,
                                                         block=self.fp8_block)
            return moe_experts_fused(x, w13, w2, weights, ids, self.activation_limit, addend=shared, **fp8, **skip)
        if self.fp8_block is not None:
            out = moe_experts_fp8_reference(x, self.w13, self.w2, weights, ids, self.activation_limit, self.w13_scale_inv,
                                            self.w2_scale_inv, self.fp8_block, **skip)
        else:
            out = moe_experts_reference(x, w13, w2, weights, ids, self.activation_limit, **skip)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def extra_repr(self) -> str:
        r = self.router
        return (f"experts={r.num_experts} (top {r.top_k}, {r.scoring}, groups {r.topk_groups}/{r.num_groups}, "
                f"scale {r.routed_scaling_factor}), width={self.intermediate_size}, backend={self.backend}"
                + (f", fp8 blocks={self.fp8_block}" if self.fp8_block else "")
                + (f", 4-bit experts in groups of {self.fp4_group}" if self.fp4_group else ""))
