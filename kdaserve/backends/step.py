"""A step as the KDA backends see it:

    step = backends.build_step(metadata)                        # once per step, before the layers
    backends.prefill.prefill(inputs, weights, cache, step.prefill, out)   # each layer
    backends.decode.decode(inputs, weights, cache, step.decode, out)

`KDAStepMetadata` is what the engine knows of the step (docs/kda-semantics.md section 3), with the
names the staged step buffers carry from the scheduler on; `KDAStep` is what the resolved pair
builds from it once (vLLM's per-backend metadata builder): its sequences (kdaserve.ops.kda.types:
PrefillSeqs, DecodeSeqs) and what the prefill backend prepared for them once (host tables, device
work tables, launch choices). It is the only KDA form a layer reads. `KDAInputs` and `KDACache` are
the op-level types every entry point takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kdaserve.ops.kda.types import CheckpointRequests, DecodeSeqs, KDACache, KDAInputs, PrefillSeqs

__all__ = ["DecodeSeqs", "KDACache", "KDAInputs", "KDAStep", "KDAStepMetadata", "PrefillPlan", "PrefillSeqs"]


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
    prefill_cu_seqlens_cpu: torch.Tensor | None = None  # host copy (conv tables without a sync)
    prefill_state_indices: torch.Tensor | None = None   # [num_prefills] int32
    prefill_has_initial_state: torch.Tensor | None = None  # [num_prefills] bool
    prefill_checkpoints: CheckpointRequests | None = None  # prefix caching: states to copy mid-prefill

    @property
    def is_speculative(self) -> bool:
        return self.spec_state_indices is not None

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """The prefill sequences of one step, and what the backend prepared for them once (its
    `step_plan`; None: nothing, the backend builds per call)."""

    seqs: PrefillSeqs
    tables: Any = None


@dataclass(frozen=True, slots=True)
class KDAStep:
    """One step's KDA work as every KDA layer reads it (`Context.kda`): decode rows first, then the
    prefill rows; each part's sequences (None where the step has none). `built_by` is the resolved
    pair that built it: its prefill tables fit that pair's kernels and heads only."""

    num_decodes: int
    num_decode_tokens: int
    num_prefill_tokens: int
    decode: DecodeSeqs | None
    prefill: PrefillPlan | None
    built_by: Any

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_speculative(self) -> bool:
        return self.decode is not None and self.decode.spec_state_indices is not None
