"""Linear layers that take checkpoint tensors directly: `MergedLinear`, whose weight is several
checkpoint tensors stacked along the output dim (q|k|v, gate|up: one GEMM instead of several, each
shard written by `load_shard`), `Fp8Linear`, one block-scaled FP8 weight, and `Fp4Linear`, one 4-bit
weight (MXFP4 / NVFP4 in ops/fp4/weights.py's form, run by ops/fp4/linear.py; a merged weight takes
it too, its shards' global scales kept per row).

With `fp8_block` (rows, cols) a layer keeps its weight as released in FP8 (DeepSeek-V3's format)
with `weight_scale_inv`, one fp32 factor per block, and runs the block-scaled FP8 GEMM
(ops/fp8/block_gemm.py; on a CPU without the Triton interpreter, the dequantized torch
definition). A merged FP8 weight needs every shard to be a whole number of row blocks, so shards
never share a scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
from torch import nn

from kdaserve.layers.distributed import local_slice
from kdaserve.layers.kernel_choice import takes_triton
from kdaserve.ops.fp4.weights import SCHEME_GROUP, Fp4Weights, scale_storage
from kdaserve.ops.fp8.reference import FP8


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for a block-scaled FP8 weight: the Triton GEMM where Triton runs (a GPU, or
    the interpreter on a CPU), else the torch definition."""
    if x.is_cuda or triton.knobs.runtime.interpret:
        from kdaserve.ops.fp8.block_gemm import block_fp8_linear

        return block_fp8_linear(x, weight, scale_inv, block, bias)
    from kdaserve.ops.fp8.reference import block_fp8_linear_reference

    return block_fp8_linear_reference(x.reshape(-1, x.shape[-1]), weight, scale_inv, block, bias).view(
        *x.shape[:-1], weight.shape[0])


def fp4_linear_any(x: torch.Tensor, weights: Fp4Weights, bias: torch.Tensor | None = None,
                   backend: str = "auto") -> torch.Tensor:
    """x W^T (+ bias) for a 4-bit weight: the Triton GEMM where the layer's per-call `backend` takes
    it (layers/kernel_choice.takes_triton: `triton`, or `auto` on a GPU), else the definition."""
    if takes_triton(backend, x):
        from kdaserve.ops.fp4.linear import fp4_linear

        return fp4_linear(x, weights, bias)
    return F.linear(x, weights.dequantized(x.dtype), bias)


def _make_fp4_weight(module: nn.Module, out_features: int, in_features: int, scheme: str, device, backend: str) -> None:
    """`weight` (packed codes), `weight_scale` and for NVFP4 `weight_global_scale` (one per row) on `module`."""
    group = SCHEME_GROUP[scheme]
    if in_features % group:
        raise ValueError(f"a 4-bit ({scheme}) weight of {in_features} inputs: the inputs must be a multiple of {group}")

    def param(*shape, dtype=torch.uint8):
        return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

    module.fp4_group, module.fp4_backend = group, backend
    module.weight = param(out_features, in_features // 2)
    # rows 16 bytes apart (ops/fp4/weights.scale_storage)
    module.weight_scale = nn.Parameter(scale_storage(out_features, in_features // group, device=device), requires_grad=False)
    module.weight_global_scale = param(out_features, dtype=torch.float32) if group == 16 else None


def fp4_weights_of(module: nn.Module) -> Fp4Weights:
    """A 4-bit linear module's weight in ops/fp4/weights.py's form (views of its parameters)."""
    return Fp4Weights(module.weight, module.weight_scale, module.weight_global_scale, module.fp4_group)


class MergedLinear(nn.Module):
    def __init__(self, in_features: int, shard_sizes: list[int], *, bias: bool = False, dtype=None, device=None,
                 fp8_block: tuple[int, int] | None = None, fp4: str | None = None, fp4_backend: str = "auto"):
        """`fp4` ("mxfp4" / "nvfp4"): a 4-bit weight, run by the Triton GEMM where `fp4_backend` (a
        per-call choice: auto, triton or reference) takes it."""
        super().__init__()
        self.in_features, self.shard_sizes = in_features, list(shard_sizes)
        self.offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes) + 1)]
        self.fp8_block, self.fp4_group = fp8_block, None
        out = self.offsets[-1]
        if fp4 is not None:
            _make_fp4_weight(self, out, in_features, fp4, device, fp4_backend)
        elif fp8_block is not None:
            br, bc = fp8_block
            if any(n % br for n in shard_sizes):
                raise ValueError(f"an FP8 merged weight needs shards of whole {br}-row blocks, got {shard_sizes}")
            self.weight = nn.Parameter(torch.empty(out, in_features, dtype=FP8, device=device), requires_grad=False)
            self.weight_scale_inv = nn.Parameter(
                torch.empty(out // br, triton.cdiv(in_features, bc), dtype=torch.float32, device=device), requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype, device=device), requires_grad=False) if bias else None

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into rows [offsets[shard], offsets[shard+1]) of weight/bias
        (of weight_scale_inv's row blocks for an FP8 weight's scale)."""
        param = getattr(self, param_name, None)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name!r} for a linear layer built without one")
        lo, hi = self.offsets[shard], self.offsets[shard + 1]
        if param_name == "weight_global_scale":   # one value for the shard: each of its rows divides by it
            if tensor.numel() != 1:
                raise ValueError(f"shard {shard}'s weight_global_scale must be one value, got {list(tensor.shape)}")
            with torch.no_grad():   # through the parameter: the write moves its version counter (load_named_tensor)
                param[lo:hi] = tensor.reshape(()).float()
            return
        if param_name == "weight_scale_inv":
            lo, hi = lo // self.fp8_block[0], hi // self.fp8_block[0]
        expected = (hi - lo, *param.shape[1:])
        tensor = local_slice(tensor, expected)   # tensor parallel: this rank's rows of the whole shard
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shard {shard} of {param_name} must have shape {expected}, got {tuple(tensor.shape)}")
        if param.dtype == torch.uint8 and tensor.dtype != torch.uint8:
            raise ValueError(f"shard {shard} of a 4-bit weight's {param_name} arrived as {tensor.dtype}; it must come packed "
                             f"(uint8 codes and scales)")
        if param.dtype == FP8 and tensor.dtype != FP8:
            raise ValueError(f"shard {shard} of an FP8 weight arrived as {tensor.dtype}; it must come quantized with its "
                             f"weight_scale_inv")
        with torch.no_grad():
            param[lo:hi].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp4_group is not None:
            return fp4_linear_any(x, fp4_weights_of(self), self.bias, self.fp4_backend)
        if self.fp8_block is not None:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, self.bias)
        return F.linear(x, self.weight, self.bias)


class Fp8Linear(nn.Module):
    """A bias-free linear layer with a block-scaled FP8 weight [out, in] and its scales."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], *, device=None):
        super().__init__()
        br, bc = block
        self.block = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(triton.cdiv(out_features, br), triton.cdiv(in_features, bc), dtype=torch.float32, device=device),
            requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in_features={inp}, out_features={out}, fp8 blocks={self.block}"


class Fp4Linear(nn.Module):
    """A bias-free linear layer with a 4-bit weight [out, in] (`weight` packed, `weight_scale`, and for
    NVFP4 `weight_global_scale` per row: the checkpoint's one value fills every row at load)."""

    def __init__(self, in_features: int, out_features: int, scheme: str, *, device=None, backend: str = "auto"):
        super().__init__()
        _make_fp4_weight(self, out_features, in_features, scheme, device, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp4_linear_any(x, fp4_weights_of(self), backend=self.fp4_backend)

    def extra_repr(self) -> str:
        out, half = self.weight.shape
        return f"in_features={2 * half}, out_features={out}, 4-bit in groups of {self.fp4_group}"


def make_linear(in_features: int, out_features: int, *, dtype, device, fp8_block: tuple[int, int] | None = None,
                fp4: str | None = None, fp4_backend: str = "auto") -> nn.Module:
    """A bias-free projection: 4-bit with `fp4` ("mxfp4" / "nvfp4"), FP8 when `fp8_block` is given, else
    nn.Linear in `dtype`."""
    if fp4 is not None:
        return Fp4Linear(in_features, out_features, fp4, device=device, backend=fp4_backend)
    if fp8_block is not None:
        return Fp8Linear(in_features, out_features, fp8_block, device=device)
    lin = nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
    lin.weight.requires_grad_(False)
    return lin
