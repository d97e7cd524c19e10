"""Per-step metadata, set by the engine's model runner before a forward and read by the layers.

One context object instead of metadata threaded through every signature (nano-vllm's design):
the KDA layers' step (`KDAStep`, built once per step by the resolved KDA backends) and the paged
attention layers' metadata. Both are built on the host from host data; their device tensors are
views of the step's staged buffer, copied without a device->host sync. `kda is None` means "no
step" (profiling or dummy runs): KDA layers then return without touching any state.

Token order in a step: **decode tokens first** (one per decode sequence, or S+1 per speculative
sequence), then the prefill tokens, so the decode part is a fixed-shape prefix that a CUDA graph
captured on a decode batch can replay.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.backends.step import KDAStep
from kdaserve.layers.attention_metadata import AttentionMetadata

__all__ = ["Context", "get_context", "reset_context", "set_context"]


@dataclass(slots=True)
class Context:
    kda: KDAStep | None = None
    attn: AttentionMetadata | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(ctx: Context) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def reset_context() -> None:
    set_context(Context())
