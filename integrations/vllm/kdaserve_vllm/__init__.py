"""kdaserve's KDA core inside vLLM (docs/vllm-plugin.md).

vLLM runs every `vllm.general_plugins` entry point's function in each of its processes (front end,
engine core, every worker) before it builds the model. `register()` makes vLLM build
`KdaserveKimiKDA` wherever it would build its `KimiGatedDeltaNetAttention` (Kimi-Linear's KDA
layer) and `KdaserveGlmKDA` for `Glm5NextLinearAttention` (GLM-5.3-Flash's): subclasses that keep
vLLM's projections, tensor-parallel sharding, weight loading, state layout and metadata, and
replace only the KDA core. They do nothing unless asked: a layer without `--additional-config
'{"kdaserve": {...}}'` (or KDASERVE_VLLM_PREFILL_BACKEND / KDASERVE_VLLM_DECODE_BACKEND in the
environment) runs vLLM's own core.

`register()` is idempotent and imports vLLM's layer modules only when called (by vLLM). GLM's
module imports vLLM's GLM model package, which needs what vLLM's GLM model needs (torchvision,
through GLM-4.1V's image processing); where that import fails vLLM cannot build a GLM model
either, so the GLM layer is skipped with one line and Kimi's stays registered."""

from __future__ import annotations

import logging

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention

    from kdaserve_vllm.kimi_kda import KdaserveKimiKDA

    KimiGatedDeltaNetAttention.register_oot(KdaserveKimiKDA)
    try:
        from vllm.models.glm5next.common.kda import Glm5NextLinearAttention

        from kdaserve_vllm.glm_kda import KdaserveGlmKDA
    except ImportError as exc:
        logging.getLogger("vllm.plugins.kdaserve").info(
            "kdaserve_vllm: GLM-5.3-Flash's KDA layer not registered (vLLM's GLM model does not import here: %s)", exc)
    else:
        Glm5NextLinearAttention.register_oot(KdaserveGlmKDA)
    _registered = True


__all__ = ["register"]
