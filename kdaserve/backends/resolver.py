"""Backend names -> loaded implementations, checked against the machine and the layer's settings.

- An unknown name is an error that lists the valid names.
- An explicitly requested backend whose requirements are not all met is an error that lists
  every unmet requirement: never a silent fallback.
- `auto` takes the fastest eligible backend for the platform (registry.AUTO_ORDER) and logs why
  faster ones were skipped. Resolution runs once per model (kda_backends.py), not per layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from kdaserve.backends import registry
from kdaserve.backends.registry import BackendSpec
from kdaserve.backends.requirements import LayerSettings, Machine, dtype_name, unmet_requirements
from kdaserve.backends.step import DecodeSeqs, KDACache, KDAInputs, PrefillPlan, PrefillSeqs

logger = logging.getLogger("kdaserve.backends")

class BackendError(ValueError):
    """A backend cannot be used as asked (raised at layer construction, i.e. at startup)."""


class UnknownBackendError(BackendError):
    pass


class BackendUnavailableError(BackendError):
    def __init__(self, message: str, unmet: list[str]):
        super().__init__(message)
        self.unmet = unmet


@dataclass(frozen=True)
class ResolvedBackend:
    """A loaded backend of one phase. Layers call it with typed objects (kdaserve.backends.step);
    `fn` is the op's entry point underneath (the calling convention of kdaserve.ops.kda.reference)."""

    phase: str
    name: str
    requested: str
    fn: Callable
    spec: BackendSpec
    planner: Callable | None = None

    @property
    def graph_capturable(self) -> bool:
        return self.spec.graph_capturable

    def plan_prefill(self, seqs: PrefillSeqs, num_tokens: int, num_heads: int, settings: LayerSettings) -> PrefillPlan:
        """The step's prefill plan, with what this backend prepares once for all layers."""
        ck = seqs.checkpoints
        if ck is not None and not self.spec.takes_checkpoints:
            raise ValueError(f"the {self.name} prefill backend takes no state checkpoints inside a step; the engine "
                             f"cuts its prefill chunks at checkpoint boundaries instead")
        tables = None if self.planner is None else self.planner(
            seqs.cu_seqlens, seqs.cu_seqlens_cpu, num_tokens, num_heads, settings)
        return PrefillPlan(seqs, tables)

    @property
    def takes_checkpoints(self) -> bool:
        return self.spec.takes_checkpoints

    def prefill(self, inputs: KDAInputs, weights, cache: KDACache, plan: PrefillPlan, out) -> None:
        extra = {} if plan.tables is None else {"step_plan": plan.tables}
        self.fn(inputs, weights, cache, plan.seqs, out, **extra)

    def decode(self, inputs: KDAInputs, weights, cache: KDACache, seqs: DecodeSeqs, out) -> None:
        self.fn(inputs, weights, cache, seqs, out)

    def conv_weight_decode_layout(self) -> Callable | None:
        """`fn(conv_weight, out=None)` building the derived conv-weight layout, if the backend reads one."""
        loader = self.spec.conv_weight_decode_layout
        return loader() if loader is not None else None


def valid_names(phase: str) -> tuple[str, ...]:
    return ("auto",) + registry.backend_names(phase)


def check_backend(phase: str, name: str, settings: LayerSettings, machine: Machine) -> list[str]:
    """Every unmet requirement of one named backend ([] when it can run)."""
    spec = registry.get_spec(phase, name)
    if spec is None:
        raise UnknownBackendError(_unknown_message(phase, name))
    return unmet_requirements(spec.requirements(), machine, settings)


def _unknown_message(phase: str, name: str) -> str:
    return f"unknown KDA {phase} backend {name!r}; valid names: {', '.join(valid_names(phase))}"


def describe_settings(s: LayerSettings) -> str:
    return (
        f"{dtype_name(s.input_dtype)} inputs, head size {s.head_dim}, {s.gate} gate, "
        f"{dtype_name(s.state_dtype)} state, {s.conv_layout} conv layout, "
        f"{s.num_spec_tokens} speculative tokens"
    )


def _load(spec: BackendSpec) -> Callable:
    try:
        return spec.load()
    except ImportError as err:
        raise BackendUnavailableError(
            f"KDA {spec.phase} backend {spec.name!r} meets its requirements but failed to import: {err}", [str(err)]
        ) from err


def _load_planner(spec: BackendSpec) -> Callable | None:
    return spec.planner() if spec.planner is not None else None


def resolve_backend(
    phase: str, requested: str, settings: LayerSettings, machine: Machine | None = None, *, context: str = ""
) -> ResolvedBackend:
    """The backend to run `phase` with, for a layer of `settings` on `machine` (detected if None)."""
    if phase not in registry.PHASES:
        raise ValueError(f"phase must be one of {registry.PHASES}, got {phase!r}")
    machine = machine or Machine.detect()
    where = f"{machine.describe_platform()}, {describe_settings(settings)}"
    if requested != "auto":
        unmet = check_backend(phase, requested, settings, machine)
        if unmet:
            lines = "\n".join(f"  - {u}" for u in unmet)
            raise BackendUnavailableError(
                f"KDA {phase} backend {requested!r} cannot run here ({where}); "
                f"{len(unmet)} unmet requirement{'s' if len(unmet) > 1 else ''}:\n{lines}",
                unmet,
            )
        spec = registry.get_spec(phase, requested)
        return ResolvedBackend(phase, requested, requested, _load(spec), spec, _load_planner(spec))

    # auto: the fastest eligible backend. One that meets its requirements but fails to import (a
    # kernel still being written, a broken install) is passed over with a warning, never silently.
    skipped = []
    for name in registry.AUTO_ORDER[machine.platform][phase]:
        spec = registry.get_spec(phase, name)
        if spec is None:
            continue
        unmet = check_backend(phase, name, settings, machine)
        if unmet:
            skipped.append(f"{name}: {'; '.join(unmet)}")
            continue
        try:
            fn = _load(spec)
        except BackendUnavailableError as err:
            logger.warning("KDA %s backend %r skipped by auto: %s", phase, name, err)
            skipped.append(f"{name}: failed to import ({err.unmet[0]})")
            continue
        if skipped:
            logger.info("KDA %s backend%s: auto -> %s, skipping %s", phase, f" [{context}]" if context else "", name,
                        " | ".join(skipped))
        return ResolvedBackend(phase, name, "auto", fn, spec, _load_planner(spec))
    raise BackendUnavailableError(f"no KDA {phase} backend can run here ({where}): " + " | ".join(skipped), skipped)


def choose_auto(phase: str, settings: LayerSettings, machine: Machine) -> tuple[str | None, list[str]]:
    """By requirements alone (nothing imported): the backend `auto` would take (None if none), and
    why faster ones were skipped."""
    skipped = []
    for name in registry.AUTO_ORDER[machine.platform][phase]:
        if registry.get_spec(phase, name) is None:
            continue
        unmet = check_backend(phase, name, settings, machine)
        if not unmet:
            return name, skipped
        skipped.append(f"{name}: {'; '.join(unmet)}")
    return None, skipped


def describe_backends(machine: Machine | None = None, settings: LayerSettings | None = None) -> list[dict]:
    """For `kdaserve info`: every backend of both phases, whether it can run on this machine with the
    default layer settings (bf16 on GPU / fp32 on CPU, head 128, bounded gate, fp32 state, SD
    layout, no speculation), and if not, why. Nothing is imported."""
    machine = machine or Machine.detect()
    settings = settings or LayerSettings.defaults_for(machine)
    rows = []
    for phase in registry.PHASES:
        for name in registry.backend_names(phase):
            unmet = check_backend(phase, name, settings, machine)
            rows.append({"phase": phase, "name": name, "runnable": not unmet, "unmet": unmet})
    return rows
