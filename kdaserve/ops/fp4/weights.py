"""The one form 4-bit weights take inside kdaserve, whatever checkpoint format they came from.

    packed   uint8 [..., rows, cols / 2]       e2m1 codes, element 2k in the low nibble (as released)
    scale    uint8 [..., rows, cols / group]   MXFP4 (group 32): e8m0 codes; NVFP4 (group 16): e4m3 bits
    divisor  fp32  [..., rows] or None          NVFP4's global scale, per output row (it divides)

The global scale is kept per row rather than per tensor so that weights merged by rows (gate|up)
or sliced by rows (tensor parallel) carry their own; the MXFP4 form has none. The leading
dimensions are experts (a MoE layer's stacked weights) or absent (one linear layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.ops.fp4.reference import MX_GROUP, NV_GROUP, dequantize_mxfp4, dequantize_nvfp4

SCHEME_GROUP = {"mxfp4": MX_GROUP, "nvfp4": NV_GROUP}


@dataclass(frozen=True)
class Fp4Weights:
    packed: torch.Tensor
    scale: torch.Tensor
    divisor: torch.Tensor | None
    group: int

    def __post_init__(self):
        rows, half = self.packed.shape[-2:]
        want_scale = (*self.packed.shape[:-1], 2 * half // self.group)
        if self.packed.dtype != torch.uint8 or self.scale.dtype != torch.uint8 or tuple(self.scale.shape) != want_scale:
            raise ValueError(f"4-bit weights need packed uint8 [..., rows, cols/2] and uint8 scales {list(want_scale)} "
                             f"(one per {self.group} values); got {self.packed.dtype} {list(self.packed.shape)} and "
                             f"{self.scale.dtype} {list(self.scale.shape)}")
        if (self.group == NV_GROUP) != (self.divisor is not None) or self.group not in (MX_GROUP, NV_GROUP):
            raise ValueError(f"4-bit weights in groups of {self.group}: MXFP4 (32) has no divisor, NVFP4 (16) one per row")
        if self.divisor is not None and tuple(self.divisor.shape) != tuple(self.packed.shape[:-1]):
            raise ValueError(f"the NVFP4 divisor must be one fp32 per row {list(self.packed.shape[:-1])}, "
                             f"got {list(self.divisor.shape)}")

    @property
    def shape(self) -> torch.Size:
        """The full-precision weight's shape."""
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))

    @property
    def scheme(self) -> str:
        return "mxfp4" if self.group == MX_GROUP else "nvfp4"

    def __getitem__(self, i) -> Fp4Weights:
        """Expert `i` of a stack (or any index on the leading dimensions)."""
        return Fp4Weights(self.packed[i], self.scale[i], None if self.divisor is None else self.divisor[i], self.group)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` by the format's definition (ops/fp4/reference.py)."""
        if self.divisor is None:
            return dequantize_mxfp4(self.packed, self.scale, dtype)
        return dequantize_nvfp4(self.packed, self.scale.view(torch.float8_e4m3fn), self.divisor[..., None], dtype)

    def contiguous(self) -> Fp4Weights:
        d = self.divisor
        return Fp4Weights(self.packed.contiguous(), self.scale.contiguous(), None if d is None else d.contiguous(),
                          self.group)
