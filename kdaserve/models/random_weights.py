"""Deterministic random checkpoints from a seed (the built-in models need no download).

Scales keep a pre-norm residual stream well-behaved at any depth, and the LM head is scaled up so
logits are peaked: greedy choices then have clear margins over floating-point noise, which makes
"batched equals alone" comparisons meaningful."""

from __future__ import annotations

import math

import torch

from kdaserve.models.hybrid_config import HybridConfig
from kdaserve.models.weight_names import checkpoint_shapes

_FP32_NAMES = ("_conv1d.weight", ".A_log", ".dt_bias")   # stored in fp32 in real checkpoints


def random_checkpoint(config: HybridConfig, seed: int = 0, *, dtype=torch.float32, device="cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    num_layers = config.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_shapes(config).items():
        dt = torch.float32 if name.endswith(_FP32_NAMES) else dtype

        def randn(std: float) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(std).to(dt)

        if name.endswith("norm.weight"):
            t = 1.0 + randn(0.1)
        elif name.endswith("_conv1d.weight"):
            t = randn(shape[-1] ** -0.5)
        elif name.endswith(".A_log"):   # exp(A_log) in [1, 16], as in real checkpoints
            t = torch.rand(shape, generator=gen, device=device).mul_(15).add_(1).log_()
        elif name.endswith(".dt_bias"):
            t = randn(0.5)
        elif name.endswith(".bias"):
            t = randn(0.02)
        elif name == "model.embed_tokens.weight":
            t = randn(1.0)
        elif name == "lm_head.weight":
            t = randn(4.0 / math.sqrt(shape[1]))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):   # writes into the residual stream
            t = randn(1.0 / math.sqrt(shape[1] * 2 * num_layers))
        else:
            t = randn(1.0 / math.sqrt(shape[-1]))
        out[name] = t
    return out


def realistic_released_tensors(shapes: dict[str, tuple[int, ...]], seed: int, *, dtype, device, layers: int, embed: str,
                               correction_bias: str, out_projections: tuple[str, ...]):
    """Random tensors under a family's released names (Kimi-Linear's, Ling-3's), one at a time (a
    large model never exists twice in memory), scaled so activations stay O(1) at any depth and the
    gates are realistic: exp(A_log) in [1, 16], dt_bias the inverse softplus of dt in [1e-3, 1e-1]
    (FLA's and transformers' initialisation), router scores spread over the experts, the
    correction bias random (transformers' zero would hide a missing term). `embed`: the embedding's
    name; names ending with `correction_bias` or one of `out_projections` (the residual branches'
    last projections, scaled down by depth) get their own rules. Yields (name, tensor)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    f32 = torch.float32

    def randn(shape, std, dt=dtype):
        return torch.randn(shape, generator=gen, device=device, dtype=f32).mul_(std).to(dt)

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = 1.0 + randn(shape, 0.1)
        elif name.endswith("_conv1d.weight"):
            t = randn(shape, shape[-1] ** -0.5, f32)
        elif name.endswith(".A_log"):
            t = torch.rand(shape, generator=gen, device=device).mul_(15).add_(1).log_()
        elif name.endswith(".dt_bias"):
            dt = torch.rand(shape, generator=gen, device=device).mul_(2 * 2.302585).sub_(6.907755).exp_()
            t = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith(correction_bias):
            t = randn(shape, 0.05, f32)
        elif name.endswith("gate.weight"):   # the router
            t = randn(shape, shape[1] ** -0.5, f32)
        elif name == embed:
            t = randn(shape, 1.0)
        elif name == "lm_head.weight":
            t = randn(shape, 4.0 / shape[1] ** 0.5)
        elif name.endswith(out_projections):
            t = randn(shape, 1.0 / (shape[1] * 2 * layers) ** 0.5)
        elif name.endswith(".b_proj.weight"):   # beta logits: spread beta over (0, 1)
            t = randn(shape, 2.0 / shape[1] ** 0.5)
        else:
            t = randn(shape, shape[-1] ** -0.5)
        yield name, t
