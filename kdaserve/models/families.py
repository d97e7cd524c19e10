"""Model families by `config.json`'s `model_type`: how to parse the config, build the model and
make random weights for it. kdaserve's own hybrid is the default (its built-ins and checkpoints
carry `model_type` "kda_hybrid*")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    config_from_dict: Callable
    # build(config, *, kda_backends, mla_backend, moe_backend, dtype, device, mtp, quantization, images) -> model
    # (images: build a vision tower where the family has one)
    build: Callable
    random_weights: Callable  # random_weights(config, seed, *, dtype, device, mtp) -> iterable of (name, tensor)
    shapes: Callable | None = None   # shapes(config[, mtp]) -> {checkpoint name: shape}, for the capacity check
    has_mtp: bool = False            # can build a multi-token-prediction drafter (build(..., mtp=True))
    # fp8_tensors(config, device, quantization) -> which checkpoint tensors the model will keep in
    # FP8 (None: none), for the capacity check before anything is built. None here: the family has
    # no FP8 path (build(..., quantization="fp8") is refused before it is called).
    fp8_tensors: Callable | None = None
    # fp4_tensors(config, shapes, device, quantization) -> the group size of each released weight
    # the model will keep in 4 bits (None for the others), for the capacity check.
    fp4_tensors: Callable | None = None
    # vision_shapes(config) -> {checkpoint name: shape} of the vision tower ({} without one), for the
    # capacity check of a model built with images
    vision_shapes: Callable | None = None


def _hybrid() -> Family:
    from kdaserve.models.hybrid import HybridForCausalLM
    from kdaserve.models.hybrid_config import HybridConfig
    from kdaserve.models.random_weights import random_checkpoint

    def build(config, *, kda_backends, mla_backend, moe_backend, dtype, device, mtp=False, quantization=None,
              images=True):
        return HybridForCausalLM(config, kda_backends=kda_backends, dtype=dtype, device=device)

    def random(config, seed, *, dtype, device, mtp=False):
        return random_checkpoint(config, seed, dtype=dtype, device=device).items()

    return Family("kda_hybrid", HybridConfig.from_dict, build, random)


def _kimi_linear() -> Family:
    from kdaserve.models.kimi_linear import (
        KimiLinearForCausalLM,
        fp4_tensors,
        fp8_tensors,
        random_released_tensors,
        released_shapes,
    )
    from kdaserve.models.kimi_linear_config import KimiLinearConfig

    def build(config, *, kda_backends, mla_backend, moe_backend, dtype, device, mtp=False, quantization=None,
              images=True):
        return KimiLinearForCausalLM(config, kda_backends=kda_backends, mla_backend=mla_backend, moe_backend=moe_backend,
                                     dtype=dtype,
                                     device=device, quantization=quantization)

    def random(config, seed, *, dtype, device, mtp=False):
        return random_released_tensors(config, seed, dtype=dtype, device=device)

    return Family("kimi_linear", KimiLinearConfig.from_dict, build, random, released_shapes,
                  fp8_tensors=fp8_tensors, fp4_tensors=fp4_tensors)


def _glm5_next() -> Family:
    from kdaserve.models.glm5_next import (
        Glm5NextForCausalLM,
        fp4_tensors,
        fp8_tensors,
        random_released_tensors,
        released_shapes,
        vision_shapes,
    )
    from kdaserve.models.glm5_next_config import Glm5NextConfig

    def build(config, *, kda_backends, mla_backend, moe_backend, dtype, device, mtp=False, quantization=None,
              images=True):
        return Glm5NextForCausalLM(config, kda_backends=kda_backends, mla_backend=mla_backend, moe_backend=moe_backend,
                                   dtype=dtype,
                                   device=device, mtp=mtp, quantization=quantization, images=images)

    def random(config, seed, *, dtype, device, mtp=False):
        return random_released_tensors(config, seed, dtype=dtype, device=device, mtp=mtp)

    return Family("glm5_next", Glm5NextConfig.from_dict, build, random, released_shapes, has_mtp=True,
                  fp8_tensors=fp8_tensors, fp4_tensors=fp4_tensors, vision_shapes=vision_shapes)


def _bailing_hybrid() -> Family:
    from kdaserve.models.bailing_hybrid import (
        BailingHybridForCausalLM,
        fp4_tensors,
        fp8_tensors,
        random_released_tensors,
        released_shapes,
    )
    from kdaserve.models.bailing_hybrid_config import BailingHybridConfig

    def build(config, *, kda_backends, mla_backend, moe_backend, dtype, device, mtp=False, quantization=None,
              images=True):
        return BailingHybridForCausalLM(config, kda_backends=kda_backends, mla_backend=mla_backend,
                                        moe_backend=moe_backend, dtype=dtype, device=device, mtp=mtp,
                                        quantization=quantization)

    def random(config, seed, *, dtype, device, mtp=False):
        return random_released_tensors(config, seed, dtype=dtype, device=device, mtp=mtp)

    return Family("bailing_hybrid", BailingHybridConfig.from_dict, build, random, released_shapes, has_mtp=True,
                  fp8_tensors=fp8_tensors, fp4_tensors=fp4_tensors)


_FAMILIES = {"kimi_linear": _kimi_linear, "glm5_next": _glm5_next, "glm5_next_text": _glm5_next,
             "bailing_hybrid": _bailing_hybrid}
KNOWN_MODEL_TYPES = ("kimi_linear", "glm5_next", "bailing_hybrid", "kda_hybrid*")


def family_of(config_dict: dict) -> Family:
    """The family of a parsed config.json (its `model_type`, or its text_config's)."""
    model_type = config_dict.get("model_type") or (config_dict.get("text_config") or {}).get("model_type") or ""
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]()
    if model_type.startswith("kda_hybrid") or not model_type:
        return _hybrid()
    raise ValueError(f"config.json has model_type {model_type!r}, which kdaserve cannot load yet; "
                     f"known: {', '.join(KNOWN_MODEL_TYPES)}")


def family_of_config(config) -> Family:
    return family_of({"model_type": getattr(config, "model_type", "")})
