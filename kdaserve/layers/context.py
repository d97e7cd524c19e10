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

from kdaserve.backends.step import KDAStepMetadata, KDAStepPlan

__all__ = ["Context", "KDAStepMetadata", "get_context", "reset_context", "set_context"]


@dataclass(slots=True)
class Context:
    kda: KDAStepMetadata | None = None
    kda_plan: KDAStepPlan | None = None  # built once per step from `kda` by the KDA backends (plan_step)
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
