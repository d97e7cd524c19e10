"""The KDA backend pair of one model: what the user chose (KDABackendChoice, part of the engine
config) and what it resolved to (KDABackends), resolved once per model and shared by every KDA
layer. Commands and benchmarks read the pair from the engine, never from a layer."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kdaserve.backends.requirements import LayerSettings, Machine
from kdaserve.backends.resolver import ResolvedBackend, describe_settings, resolve_backend

logger = logging.getLogger("kdaserve.backends")


@dataclass(frozen=True, slots=True)
class KDABackendChoice:
    """The backends asked for by name ('auto' picks the fastest that can run) and the cache formats
    every KDA layer of the model uses."""

    prefill: str = "auto"
    decode: str = "auto"
    state_dtype: torch.dtype = torch.float32
    conv_layout: str = "SD"


@dataclass(frozen=True, slots=True)
class KDABackends:
    """A resolved prefill/decode pair and the layer settings it was resolved for."""

    prefill: ResolvedBackend
    decode: ResolvedBackend
    settings: LayerSettings

    @property
    def names(self) -> str:
        return f"{self.prefill.name}+{self.decode.name}"


def resolve_kda_backends(choice: KDABackendChoice, settings: LayerSettings, machine: Machine | None = None,
                         *, log: bool = True) -> KDABackends:
    """Resolve both phases for layers of `settings`; an impossible explicit choice raises
    (BackendError) listing every unmet requirement. Logs the pair once when `log`."""
    machine = machine or Machine.detect()
    pair = KDABackends(resolve_backend("prefill", choice.prefill, settings, machine),
                       resolve_backend("decode", choice.decode, settings, machine), settings)
    if log:
        logger.info("KDA backends: prefill %s (asked %s), decode %s (asked %s) for %s, %s", pair.prefill.name,
                    choice.prefill, pair.decode.name, choice.decode, machine.describe_platform(), describe_settings(settings))
    return pair
