"""Which implementation an MLA or MoE layer runs: `reference` (torch, any device) or `triton`.

`auto` takes Triton where kernels compile (CUDA, ROCm) and the reference on a CPU. An explicit
`triton` that cannot run here is an error that says what is missing, never a silent fallback."""

from __future__ import annotations

import torch
import triton

KERNEL_CHOICES = ("auto", "reference", "triton")


def resolve_kernel_choice(layer_kind: str, choice: str, device: torch.device) -> str:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown {layer_kind} backend {choice!r}; expected one of {', '.join(KERNEL_CHOICES)}")
    on_gpu = device.type == "cuda"
    if choice == "auto":
        return "triton" if on_gpu else "reference"
    if choice == "triton" and not (on_gpu or triton.knobs.runtime.interpret):
        raise ValueError(f"{layer_kind} backend 'triton' cannot run here: it needs a CUDA or ROCm device, or "
                         f"TRITON_INTERPRET=1 on the CPU (the layer is on {device}); use 'reference' or 'auto'")
    return choice


def per_call_choice(layer_kind: str, choice: str, device: torch.device) -> str:
    """For layers whose `auto` follows each call's inputs (RMSNorm, SwiGLU: a layer may be built
    before its device is known): `auto` kept as is, an explicit choice resolved now."""
    return choice if choice == "auto" else resolve_kernel_choice(layer_kind, choice, device)


def takes_triton(choice: str, x: torch.Tensor) -> bool:
    """Whether a per-call choice runs its Triton kernel on `x`: `triton`, or `auto` on a GPU."""
    return choice == "triton" or (choice == "auto" and x.is_cuda)
