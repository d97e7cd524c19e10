"""The typed objects a KDA backend is called with, instead of a dozen loose tensors:

    plan = backend.plan_prefill(metadata, num_heads)     # once per step, before the layers run
    backend.prefill(inputs, weights, cache, plan, out)   # each layer
    backend.decode(inputs, weights, cache, plan, out)

`KDAInputs` are the step's projections (views into the layer's GEMM output), `KDACache` the
layer's pools, the plans the step's metadata plus what the backend prepared for it once (host
tables, device work tables, launch choices). Metadata semantics: docs/kda-semantics.md section 3.
"""

from __future__ import annotations

from dataclasses import dataclass
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
class KDAInputs:
    qkv: torch.Tensor          # [T, 3P], columns contiguous (a column slice of the projection)
    g1: torch.Tensor           # [T, H, D] or [T, P]: forget-gate logits
    beta_logits: torch.Tensor  # [T, H]
    g2: torch.Tensor           # [T, H, D] or [T, P]: output-gate logits

    def rows(self, rows: slice) -> "KDAInputs":
        return KDAInputs(self.qkv[rows], self.g1[rows], self.beta_logits[rows], self.g2[rows])


@dataclass(slots=True)
class KDACache:
    conv_state: torch.Tensor       # SD [slots, W-1+S, 3P] or DS [slots, 3P, W-1+S]
    recurrent_state: torch.Tensor  # [slots, H, V, K]
    conv_layout: str = "SD"


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """The prefill sequences of one step, and the backend's tables for them (None: the backend
    prepares nothing ahead, or builds per call)."""

    cu_seqlens: torch.Tensor              # [N+1] int32, relative to the prefill tokens
    cu_seqlens_cpu: torch.Tensor | None   # its host copy (grids without a device sync)
    state_indices: torch.Tensor           # [N] int32, <= 0: padding
    has_initial_state: torch.Tensor       # [N] bool
    tables: Any = None


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """The decode (or speculative verify) sequences of one step."""

    state_indices: torch.Tensor                     # [N] int32
    spec_state_indices: torch.Tensor | None = None  # [N, S+1] int32 (speculative only)
    num_accepted_tokens: torch.Tensor | None = None  # [N] int32 (speculative only)

    def spec_kwargs(self) -> dict:
        if self.spec_state_indices is None:
            return {}
        return dict(spec_state_indices=self.spec_state_indices, num_accepted_tokens=self.num_accepted_tokens)


@dataclass(frozen=True, slots=True)
class KDAStepPlan:
    """One step's plans for both parts (None where the step has no such sequences)."""

    prefill: PrefillPlan | None = None
    decode: DecodePlan | None = None
