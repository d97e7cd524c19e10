"""Per-step metadata, set by the engine's model runner before a forward and read by the layers.

One context object instead of metadata threaded through every signature (nano-vllm's design).
Everything here is built on the host from host data; device tensors are copies made without a
device->host sync. `kda is None` means "no metadata" (profiling or dummy runs): KDA layers then
return without touching any state.

Token order in a step: **decode tokens first** (one per decode sequence, or S+1 per speculative
sequence), then the prefill tokens, so the decode part is a fixed-shape prefix that a CUDA graph
captured on a decode batch can replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class KDAStepMetadata:
    """What docs/kda-semantics.md section 3 lists, split by route."""

    num_decodes: int = 0                 # decode sequences (plain or speculative), first in the step
    num_decode_tokens: int = 0           # num_decodes, or num_decodes * (S+1) when speculative
    decode_state_indices: torch.Tensor | None = None   # [num_decodes] int32, <= 0 = padding
    spec_state_indices: torch.Tensor | None = None     # [num_decodes, S+1] int32 (speculative only)
    num_accepted_tokens: torch.Tensor | None = None    # [num_decodes] int32 (speculative only)
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    prefill_cu_seqlens: torch.Tensor | None = None      # [num_prefills+1] int32, relative to the prefill part
    prefill_cu_seqlens_cpu: torch.Tensor | None = None  # host copy (chunk tables without a sync)
    prefill_state_indices: torch.Tensor | None = None   # [num_prefills] int32
    prefill_has_initial_state: torch.Tensor | None = None  # [num_prefills] bool

    @property
    def is_speculative(self) -> bool:
        return self.spec_state_indices is not None

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens


@dataclass(slots=True)
class Context:
    kda: KDAStepMetadata | None = None
    attn: Any = None                 # the full-attention layers' metadata (engine-defined)
    extras: dict = field(default_factory=dict)


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(ctx: Context) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def reset_context() -> None:
    set_context(Context())
