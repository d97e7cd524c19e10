"""The precision of fp32 dot operands per target, in one place (the `input_precision` of tl.dot).

Kernels that feed fp32 operands to tensor cores ask here instead of naming `tf32`: not every
target has it (gfx950 offers `ieee`, `bf16x3`, `bf16x6`; ROCm has no `tf32x3`). Two roles:
- `tensor_core`: dots whose inputs were rounded to 16 bits anyway (flash's K1 feeding an fp16
  workspace, attention over a 16-bit cache): tf32's 10-bit mantissa loses nothing they kept;
- `exact`: dots that must be fp32-accurate (flash's scan of segment maps).
Dots of 16-bit operands ignore the setting. The interpreter and the CPU compute IEEE fp32.
Accuracy of each choice against fp64 (a [64, 128] x [128, 64] product of random fp32 matrices,
emulated on the CPU, tools/dot_precision_accuracy.py): docs/portability.md."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DotPrecision:
    tensor_core: str
    exact: str


IEEE = DotPrecision("ieee", "ieee")
# By architecture family: NVIDIA from Ampere on has tf32 and Triton's 3-pass tf32x3; gfx942
# (MI300) has xf32 (Triton's tf32) and no 3-pass form; gfx950 (MI355) has neither, and bf16x3 /
# bf16x6 (3 and 6 bf16 passes) are its nearest, about tf32's accuracy or better and near fp32's.
BY_TARGET: dict[str, DotPrecision] = {
    "sm_80+": DotPrecision("tf32", "tf32x3"),
    "gfx942": DotPrecision("tf32", "ieee"),
    "gfx950": DotPrecision("bf16x3", "bf16x6"),
}


def precision_for_target(target: str) -> DotPrecision:
    """`target`: "sm_90", "sm_100", "gfx950", ... (anything else, the CPU or the interpreter: IEEE)."""
    if target.startswith("sm_") and int(target[3:]) >= 80:
        return BY_TARGET["sm_80+"]
    return BY_TARGET.get(target, IEEE)


def device_target(device: torch.device) -> str:
    """"sm_90", "gfx950", ... for a GPU device; "cpu" otherwise (the interpreter included)."""
    if device.type != "cuda":
        return "cpu"
    return _gpu_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _gpu_target(index: int) -> str:
    if torch.version.hip:
        return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


# Targets with 227 KB of shared memory per program (Hopper, Blackwell's data-center parts): launch
# shapes measured on an H200 that need it are taken only there. "cpu" (the interpreter) plans as an
# H200 does, as num_sms does.
WIDE_SHARED_MEMORY_TARGETS = ("sm_90", "sm_100", "sm_103", "cpu")

# Targets whose tensor cores multiply e2m1 with e8m0 block scales themselves (Blackwell's data-center
# parts, MI355X): MXFP4 weights enter `tl.dot_scaled` as stored there. Elsewhere Triton would
# decompose that dot into the same upcast the register decoding does (ops/fp4/tiles.py), so the
# decoding path stays the rule.
NATIVE_FP4_DOT_TARGETS = ("sm_100", "sm_103", "gfx950")


def native_fp4_dots(target: str) -> bool:
    return target in NATIVE_FP4_DOT_TARGETS


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (compute units on AMD) of a GPU; 132 (an H200) for the interpreter,
    so CPU tests plan launches as the GPU would."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def dot_precision(device: torch.device) -> DotPrecision:
    return precision_for_target(device_target(device))
