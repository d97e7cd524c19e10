"""What each prefill backend prepares once per step, before its layers run (BackendSpec.planner):
`plan(cu_seqlens, cu_seqlens_cpu, num_tokens, num_heads, settings) -> tables`, passed to every
layer's call as `step_plan`. The table-based planners need the host copy of cu_seqlens and
prepare nothing without it (None: each call then builds what it needs, as tests and tools do);
flash's plan is built on the device and needs no host copy. Ops are imported when first used."""

from __future__ import annotations

import torch

from kdaserve.backends.requirements import LayerSettings


def conv_tables(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None, num_tokens: int, num_heads: int,
                settings: LayerSettings):
    """Backends that run our varlen conv before another library's core (fla, flashkda, aiter)."""
    from kdaserve.ops.kda.conv import conv_step_tables
    from kdaserve.ops.kda.host_tables import host_offsets

    return None if cu_seqlens_cpu is None else conv_step_tables(host_offsets(cu_seqlens_cpu), cu_seqlens.device)


def flash_plan(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None, num_tokens: int, num_heads: int,
               settings: LayerSettings):
    from kdaserve.ops.kda.flash import flash_step_plan

    return flash_step_plan(cu_seqlens, cu_seqlens_cpu, num_tokens, num_heads, settings.head_dim,
                           settings.lower_bound is not None, input_dtype=settings.input_dtype)
