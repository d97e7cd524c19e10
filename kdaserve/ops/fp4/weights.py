"""The one form 4-bit weights take inside kdaserve, whatever checkpoint format they came from.

    packed   uint8 [..., rows, cols / 2]       e2m1 codes, element 2k in the low nibble (as released)
    scale    uint8 [..., rows, cols / group]   MXFP4 (group 32): e8m0 codes; NVFP4 (group 16): e4m3 bits
    divisor  fp32  [..., rows] or None          NVFP4's global scale, per output row (it divides)

The global scale is kept per row rather than per tensor so that weights merged by rows (gate|up)
or sliced by rows (tensor parallel) carry their own; the MXFP4 form has none. The leading
dimensions are experts (a MoE layer's stacked weights) or absent (one linear layer).

Scale rows are stored 16 bytes apart (`scale_storage`: padding past each row's last group, the
tensor a view). Triton specializes a stride divisible by 16 and only then knows a row's scales are
aligned, so that a K step's scales load as vectors, pipelined through shared memory with the packed
bytes; Kimi-Linear's hidden 2304 has 72 MXFP4 groups a row, which would not (docs/perf-notes.md,
thirty-ninth session). The kernels take any row strides; only the last dimension must be dense."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.ops.fp4.reference import MX_GROUP, NV_GROUP, dequantize_mxfp4, dequantize_nvfp4

SCHEME_GROUP = {"mxfp4": MX_GROUP, "nvfp4": NV_GROUP}
SCALE_ROW_ALIGN = 16   # bytes between the starts of two scale rows: a multiple of this


def scale_row_bytes(groups: int) -> int:
    """Bytes a row of `groups` scales takes in `scale_storage`, its padding included."""
    return -(-groups // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN


def scale_storage(*shape: int, device=None) -> torch.Tensor:
    """Zeroed uint8 group scales [..., rows, groups], each row starting a multiple of 16 bytes after
    the last (a view of a padded tensor)."""
    return torch.zeros(*shape[:-1], scale_row_bytes(shape[-1]), dtype=torch.uint8, device=device)[..., :shape[-1]]


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

    def dense_rows(self) -> Fp4Weights:
        """These weights with each piece's last dimension contiguous, as the kernels index them (a copy
        only of a piece that is not); rows keep their strides, so aligned scale rows stay as stored."""
        def dense(t):
            return t if t is None or t.stride(-1) == 1 else t.contiguous()
        return Fp4Weights(dense(self.packed), dense(self.scale), dense(self.divisor), self.group)

    def with_aligned_scales(self) -> Fp4Weights:
        """These weights with their scales in `scale_storage` (a copy where the rows are not aligned):
        for weights made outside a layer (tests, benchmarks), once, not per call."""
        if self.scale.dim() < 2 or self.scale.stride(-2) % SCALE_ROW_ALIGN == 0:
            return self
        scale = scale_storage(*self.scale.shape, device=self.scale.device)
        scale.copy_(self.scale)
        return Fp4Weights(self.packed, scale, self.divisor, self.group)
