"""The KDA backend pair of one model: what the user chose (KDABackendChoice, part of the engine
config) and what it resolved to (KDABackends), resolved once per model by the loader and handed
down to every KDA layer; the engine keeps the loader's pair (nothing reads it back from a layer).
The pair is also the step's KDA metadata builder: `build_step` once per step, `build_for_capture`
for a CUDA graph's static buffers."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kdaserve.backends.requirements import LayerSettings, Machine
from kdaserve.backends.resolver import ResolvedBackend, describe_settings, resolve_backend
from kdaserve.backends.step import DecodeSeqs, KDAStep, KDAStepMetadata, PrefillSeqs

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
    layer (on this rank). `build_step` prepares a step for every layer at once."""

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

    def build_step(self, meta: KDAStepMetadata | None) -> KDAStep | None:
        """The step's KDA work, built once before its layers run (None: no metadata or no tokens,
        nothing runs). Host work and at most one host->device copy or planning launch per part;
        no device sync."""
        if meta is None or meta.num_tokens == 0:
            return None
        prefill = decode = None
        if meta.num_prefills:
            if meta.prefill_cu_seqlens is None or meta.prefill_state_indices is None or meta.prefill_has_initial_state is None:
                raise ValueError("KDA step metadata: prefills without cu_seqlens / state_indices / has_initial_state")
            seqs = PrefillSeqs(meta.prefill_cu_seqlens, meta.prefill_state_indices, meta.prefill_has_initial_state,
                               meta.prefill_cu_seqlens_cpu, meta.prefill_checkpoints)
            prefill = self.prefill.plan_prefill(seqs, meta.num_prefill_tokens, self.num_heads, self.settings)
        if meta.num_decodes:
            if meta.decode_state_indices is None:
                raise ValueError("KDA step metadata: decodes without decode_state_indices")
            if meta.is_speculative and meta.num_accepted_tokens is None:
                raise ValueError("KDA step metadata: speculative decodes without num_accepted_tokens")
            decode = DecodeSeqs(meta.decode_state_indices, meta.spec_state_indices, meta.num_accepted_tokens)
        return KDAStep(meta.num_decodes, meta.num_decode_tokens, meta.num_prefill_tokens, decode, prefill, self)

    def build_for_capture(self, meta: KDAStepMetadata) -> KDAStep:
        """A decode (or verify) step over a CUDA graph's static buffers: what the graph replays
        reads those buffers' addresses, never values planned on the host, so the step must be
        decodes only and the decode backend capturable."""
        if meta.num_prefills or not meta.num_decodes:
            raise ValueError(f"a CUDA graph captures decode steps only; got {meta.num_decodes} decodes and "
                             f"{meta.num_prefills} prefills")
        if not self.decode.graph_capturable:
            raise ValueError(f"the {self.decode.name} KDA decode backend cannot be captured in a CUDA graph")
        return self.build_step(meta)


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
