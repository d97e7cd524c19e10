"""Types shared by every KDA op: what an entry point is called with.

    kda_prefill_X(inputs, weights, cache, seqs, out, ...)    seqs: PrefillSeqs
    kda_decode_X(inputs, weights, cache, seqs, out, ...)     seqs: DecodeSeqs

`KDAInputs` are the step's projections (views into the layer's GEMM output), `KDAWeights` the
layer's tensors after the projections, `KDACache` its pools, the seqs the step's sequences
(docs/kda-semantics.md sections 2 and 3).
"""

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
    gate_dtype:   the log-decay gk rounded to this dtype before it is used: Ling-3's activation
                  dtype, as its transformers port casts the gate; None (Kimi-Linear, GLM-5.3-Flash):
                  gk stays in the compute dtype.
    """

    conv_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    lower_bound: float | None = -5.0
    norm_eps: float = 1e-5
    conv_weight_decode: torch.Tensor | None = None
    gate_dtype: torch.dtype | None = None

    @property
    def num_heads(self) -> int:
        return self.dt_bias.shape[0]

    @property
    def head_dim(self) -> int:
        return self.dt_bias.shape[1]

    @property
    def conv_width(self) -> int:
        return self.conv_weight.shape[1]


@dataclass(slots=True)
class KDAInputs:
    qkv: torch.Tensor          # [T, 3P], columns contiguous (a column slice of the projection)
    forget_logits: torch.Tensor           # [T, H, D] or [T, P]: forget-gate logits
    beta_logits: torch.Tensor  # [T, H]
    output_gate_logits: torch.Tensor           # [T, H, D] or [T, P]: output-gate logits

    def rows(self, rows: slice) -> "KDAInputs":
        return KDAInputs(self.qkv[rows], self.forget_logits[rows], self.beta_logits[rows], self.output_gate_logits[rows])

    def __iter__(self):  # qkv, forget_logits, beta_logits, output_gate_logits = inputs
        return iter((self.qkv, self.forget_logits, self.beta_logits, self.output_gate_logits))


@dataclass(slots=True)
class KDACache:
    conv_state: torch.Tensor       # SD [slots, W-1+S, 3P] or DS [slots, 3P, W-1+S]
    recurrent_state: torch.Tensor  # [slots, H, V, K]
    conv_layout: str = "SD"

    def __iter__(self):  # conv_state, recurrent_state, conv_layout = cache
        return iter((self.conv_state, self.recurrent_state, self.conv_layout))


def checkpoint_table_width(most: int) -> int:
    """Columns of a CheckpointRequests table holding up to `most` checkpoints per sequence: a
    power of two of at least 2 (the kernels' vector width)."""
    return max(2, 1 << (max(most, 1) - 1).bit_length())


@dataclass(slots=True)
class CheckpointRequests:
    """State checkpoints a prefill takes in the same launch (prefix caching): sequence n's
    recurrent state and conv window (the raw tokens before the point) as they are after
    `offsets[n, j]` of its new tokens, copied into state slot `slots[n, j]`. Offsets are interior
    (0 < offset < the sequence's new tokens), increasing, and multiples of the backend's chunk;
    -1 pads a row.
    The host copy decides the launch plan (no device read)."""

    offsets: torch.Tensor                     # [N, K] int32 on the device, K a power of two
    slots: torch.Tensor                       # [N, K] int32
    offsets_cpu: tuple[tuple[int, ...], ...]  # per sequence, its offsets

    @classmethod
    def build(cls, per_seq: list[list[tuple[int, int]]], device) -> "CheckpointRequests":
        """From [(offset, slot), ...] per sequence."""
        K = checkpoint_table_width(max((len(p) for p in per_seq), default=1))
        off = torch.full((len(per_seq), K), -1, dtype=torch.int32)
        slot = torch.zeros((len(per_seq), K), dtype=torch.int32)
        for n, pairs in enumerate(per_seq):
            for j, (o, sl) in enumerate(pairs):
                off[n, j], slot[n, j] = o, sl
        return cls(off.to(device), slot.to(device), tuple(tuple(o for o, _ in p) for p in per_seq))


@dataclass(slots=True)
class PrefillSeqs:
    """The prefill sequences of a step."""

    cu_seqlens: torch.Tensor              # [N+1] int32, relative to the step's tokens
    state_indices: torch.Tensor           # [N] int32, <= 0: padding (nothing read or written)
    has_initial_state: torch.Tensor       # [N] bool
    cu_seqlens_cpu: torch.Tensor | None = None  # the host copy: grids without a device sync
    checkpoints: CheckpointRequests | None = None   # prefix caching: states to copy mid-prefill

    def __iter__(self):  # cu_seqlens, state_indices, has_initial_state, cu_seqlens_cpu = seqs
        return iter((self.cu_seqlens, self.state_indices, self.has_initial_state, self.cu_seqlens_cpu))


@dataclass(slots=True)
class DecodeSeqs:
    """The decode (one token each) or speculative-verify (S+1 tokens each) sequences of a step."""

    state_indices: torch.Tensor                      # [N] int32, <= 0: padding
    spec_state_indices: torch.Tensor | None = None   # [N, S+1] int32 (speculative only)
    num_accepted_tokens: torch.Tensor | None = None  # [N] int32 (speculative only)

    def __iter__(self):  # state_indices, spec_state_indices, num_accepted_tokens = seqs
        return iter((self.state_indices, self.spec_state_indices, self.num_accepted_tokens))


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
