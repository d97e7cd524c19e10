"""The KDA backend pair of one model: what the user chose (KDABackendChoice, part of the engine
config) and what it resolved to (KDABackends), resolved once per model and shared by every KDA
layer. Commands and benchmarks read the pair from the engine, never from a layer."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kdaserve.backends.requirements import LayerSettings, Machine
from kdaserve.backends.resolver import ResolvedBackend, describe_settings, resolve_backend
from kdaserve.backends.step import DecodeSeqs, KDAStepMetadata, KDAStepPlan, PrefillSeqs

logger = logging.getLogger("kdaserve.backends")


@dataclass(frozen=True, slots=True)
class KDABackendChoice:
    """The backends asked for by name ('auto' picks the fastest that can run) and the cache formats
    every KDA layer of the model uses."""

    prefill: str = "auto"
    decode: str = "auto"
    state_dtype: torch.dtype = torch.float32
    conv_layout: str = "SD"
    num_spec_tokens: int = 0   # S draft tokens per verify step (speculative decoding), 0 = off


@dataclass(frozen=True, slots=True)
class KDABackends:
    """A resolved prefill/decode pair, the layer settings it was resolved for and the heads of each
    layer (on this rank). `plan_step` prepares a step for every layer at once."""

    prefill: ResolvedBackend
    decode: ResolvedBackend
    settings: LayerSettings
    num_heads: int

    @property
    def takes_checkpoints_in_step(self) -> bool:
        """Whether prefix caching's checkpoints go inside the prefill launch: the backend takes
        them, and the conv rows (width - 1 + speculative tokens) fit flash's smallest chunk (16),
        from whose tokens it writes a checkpoint's conv window."""
        return self.prefill.takes_checkpoints and self.settings.conv_width - 1 + self.settings.num_spec_tokens <= 16

    @property
    def names(self) -> str:
        return f"{self.prefill.name}+{self.decode.name}"

    def plan_step(self, meta: KDAStepMetadata | None) -> KDAStepPlan | None:
        """The step's plans, built once before its layers run (None: no metadata, nothing runs).
        Host work and at most one host->device copy or planning launch per part; no device sync."""
        if meta is None or meta.num_tokens == 0:
            return None
        prefill = decode = None
        if meta.num_prefills:
            seqs = PrefillSeqs(meta.prefill_cu_seqlens, meta.prefill_state_indices, meta.prefill_has_initial_state,
                               meta.prefill_cu_seqlens_cpu, meta.prefill_checkpoints)
            prefill = self.prefill.plan_prefill(seqs, meta.num_prefill_tokens, self.num_heads, self.settings)
        if meta.num_decodes:
            decode = DecodeSeqs(meta.decode_state_indices, meta.spec_state_indices, meta.num_accepted_tokens)
        return KDAStepPlan(prefill, decode)


def resolve_kda_backends(choice: KDABackendChoice, settings: LayerSettings, num_heads: int,
                         machine: Machine | None = None, *, log: bool = True) -> KDABackends:
    """Resolve both phases for layers of `settings`; an impossible explicit choice raises
    (BackendError) listing every unmet requirement. Logs the pair once when `log`."""
    machine = machine or Machine.detect()
    pair = KDABackends(resolve_backend("prefill", choice.prefill, settings, machine),
                       resolve_backend("decode", choice.decode, settings, machine), settings, num_heads)
    if log:
        logger.info("KDA backends: prefill %s (asked %s), decode %s (asked %s) for %s, %s", pair.prefill.name,
                    choice.prefill, pair.decode.name, choice.decode, machine.describe_platform(), describe_settings(settings))
    return pair
