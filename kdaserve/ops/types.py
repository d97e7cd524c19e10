"""Types shared by every KDA op: the layer's weights as kernels see them, and cache layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CONV_LAYOUTS = ("SD", "DS")


@dataclass(slots=True)
class KDAWeights:
    """The per-layer tensors a KDA core needs (after the projections).

    conv_weight:  [3P, W] fp32, merged q|k|v short-conv weight.
    A_log:        [H] fp32.
    dt_bias:      [H, D] fp32.
    norm_weight:  [D], weight of the gated RMSNorm.
    lower_bound:  bounded ("safe") gate when set (GLM-5.3-Flash, in [-5, 0)); None = unbounded
                  softplus gate (Kimi-Linear).
    conv_weight_decode: optional derived layout of conv_weight for single-launch decode kernels;
                  the layer owns and refreshes it after every weight write.
    """

    conv_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    lower_bound: float | None = -5.0
    norm_eps: float = 1e-5
    conv_weight_decode: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.dt_bias.shape[0]

    @property
    def head_dim(self) -> int:
        return self.dt_bias.shape[1]

    @property
    def conv_width(self) -> int:
        return self.conv_weight.shape[1]


def check_conv_layout(layout: str) -> None:
    if layout not in CONV_LAYOUTS:
        raise ValueError(f"conv_layout must be one of {CONV_LAYOUTS}, got {layout!r}")


def conv_state_rows(conv_state: torch.Tensor, layout: str) -> torch.Tensor:
    """A `[num_slots, L, 3P]` view of the conv-state pool, whatever its layout (no copy).

    SD pools are stored `[num_slots, L, 3P]`, DS pools `[num_slots, 3P, L]` (dim-first);
    kernels take strides, so both are one view away from the same indexing.
    """
    check_conv_layout(layout)
    return conv_state if layout == "SD" else conv_state.transpose(1, 2)
