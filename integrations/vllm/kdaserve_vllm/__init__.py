"""kdaserve's KDA core inside vLLM (docs/vllm-plugin.md).

vLLM runs every `vllm.general_plugins` entry point's function in each of its processes (front end,
engine core, every worker) before it builds the model. `register()` makes vLLM build
`KdaserveKimiKDA` wherever it would build its `KimiGatedDeltaNetAttention` (Kimi-Linear's KDA
layer): a subclass that keeps vLLM's projections, tensor-parallel sharding, weight loading, state
layout and metadata, and replaces only the KDA core (`_forward`). It does nothing unless asked: a
layer without `--additional-config '{"kdaserve": {...}}'` (or KDASERVE_VLLM_PREFILL_BACKEND /
KDASERVE_VLLM_DECODE_BACKEND in the environment) runs vLLM's own core.

`register()` is idempotent and imports vLLM's layer module only when called (by vLLM)."""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention

    from kdaserve_vllm.kimi_kda import KdaserveKimiKDA

    KimiGatedDeltaNetAttention.register_oot(KdaserveKimiKDA)
    _registered = True


__all__ = ["register"]
