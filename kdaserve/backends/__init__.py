"""KDA backends: names -> implementations, each stating its requirements (registry.py, the one
table of names: PREFILL_BACKENDS and DECODE_BACKENDS are read from it); the resolver, which turns
the engine's choice into one resolved pair per model (kda_backends.py); the pair builds each step's
KDA part once (step.py: the typed inputs, cache and step a backend is called with).
"""

from kdaserve.backends.kda_backends import KDABackendChoice, KDABackends, resolve_kda_backends
from kdaserve.backends.registry import (
    AUTO_ORDER,
    DECODE_BACKENDS,
    PREFILL_BACKENDS,
    BackendSpec,
    backend_names,
    register_backend,
    unregister_backend,
)
from kdaserve.backends.requirements import LayerSettings, Machine, Requirement, usable_device
from kdaserve.backends.resolver import (
    BackendError,
    BackendUnavailableError,
    ResolvedBackend,
    UnknownBackendError,
    check_backend,
    choose_auto,
    describe_backends,
    resolve_backend,
    valid_names,
)

__all__ = [
    "AUTO_ORDER",
    "BackendError",
    "BackendSpec",
    "BackendUnavailableError",
    "DECODE_BACKENDS",
    "KDABackendChoice",
    "KDABackends",
    "LayerSettings",
    "Machine",
    "PREFILL_BACKENDS",
    "Requirement",
    "ResolvedBackend",
    "UnknownBackendError",
    "backend_names",
    "check_backend",
    "choose_auto",
    "describe_backends",
    "register_backend",
    "resolve_backend",
    "resolve_kda_backends",
    "usable_device",
    "unregister_backend",
    "valid_names",
]
