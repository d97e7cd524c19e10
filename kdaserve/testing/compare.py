"""Comparisons that fail loudly: relative RMS error, NaN detection, bit-exact slot checks."""

from __future__ import annotations

import torch

# docs/kda-semantics.md section 5: relative RMS error against the fp64/fp32 reference.
TOLERANCES = {
    "fp32": 1e-5,        # fp32 inputs, fp32 math (CPU, interpreter)
    "fp16": 2e-3,        # fp16 inputs through the interpreter (tensor-core-style 16-bit operands)
    "bf16": 5e-3,        # bf16 inputs, fp32 state (GPU)
    "bf16_state": 2e-2,  # bf16 inputs, bf16 state
}


def tolerance_for(input_dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> float:
    if state_dtype == torch.bfloat16:
        return TOLERANCES["bf16_state"]
    if input_dtype in (torch.float32, torch.float64):
        return TOLERANCES["fp32"]
    return TOLERANCES["fp16"] if input_dtype == torch.float16 else TOLERANCES["bf16"]


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64; inf when x holds a NaN or an inf (NaN never passes)."""
    x64, ref64 = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x64).all():
        return float("inf")
    denom = ref64.norm().item()
    diff = (x64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    d = (x.detach().double() - ref.detach().double()).abs()
    return float("inf") if not torch.isfinite(d).all() else (d.max().item() if d.numel() else 0.0)


def assert_rel_close(x: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "tensor") -> None:
    assert x.shape == ref.shape, f"{what}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    err = rel_rms(x, ref)
    if not err < tol:
        nans = int(torch.isnan(x.detach()).sum())
        raise AssertionError(
            f"{what}: relative RMS error {err:.3e} >= {tol:.1e} (max abs {max_abs(x, ref):.3e}, {nans} NaN of {x.numel()})"
        )


def nan_poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a float buffer with NaN in place (so any element a kernel forgets to write fails)."""
    return t.fill_(float("nan"))


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(_SAME_SIZE_INT[t.element_size()])


def assert_slots_untouched(before: torch.Tensor, after: torch.Tensor, touched, what: str = "pool") -> None:
    """Every slot (dim 0) not in `touched` must be bit-for-bit equal (NaN payloads included)."""
    touched = {int(s) for s in touched}
    keep = [s for s in range(before.shape[0]) if s not in touched]
    idx = torch.tensor(keep, dtype=torch.long, device=before.device)
    b, a = _bits(before.index_select(0, idx)), _bits(after.index_select(0, idx))
    if not torch.equal(b, a):
        bad = [keep[i] for i in range(len(keep)) if not torch.equal(b[i], a[i])]
        raise AssertionError(f"{what}: slots outside the batch changed: {bad[:10]}")
