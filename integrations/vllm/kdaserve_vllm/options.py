"""What a vLLM run asks of kdaserve: `--additional-config '{"kdaserve": {"prefill_backend": ...,
"decode_backend": ..., "check_nan": true}}'`, or the environment (KDASERVE_VLLM_PREFILL_BACKEND,
KDASERVE_VLLM_DECODE_BACKEND), the config winning. No setting: kdaserve is not asked, vLLM's own
KDA core runs. Per phase, a name of kdaserve's (`kdaserve info` lists them), `vllm` (vLLM's own
kernels for that phase) or `auto`: kdaserve only where a measurement says it is faster than
vLLM's path, or where vLLM has no path at all (`auto_uses_vllm`). `check_nan` (default on): every
step fails loudly where a KDA layer's inputs or kdaserve's output hold NaN (kda_core.py), instead
of sampling garbage."""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_PREFILL = "KDASERVE_VLLM_PREFILL_BACKEND"
ENV_DECODE = "KDASERVE_VLLM_DECODE_BACKEND"
BACKEND_KEYS = ("prefill_backend", "decode_backend")
KEYS = (*BACKEND_KEYS, "check_nan")
VLLM = "vllm"


def auto_uses_vllm(phase: str, device_type: str, bounded_gate: bool) -> bool:
    """Does `auto` keep vLLM's own kernels for this phase? On a GPU (H200, docs/perf-notes.md):
    kdaserve's `flash` prefill is 1.6-4.6x FLA's serving path with the bounded gate but 0.79-1.12x
    with Kimi-Linear's unbounded gate, so unbounded-gate prefill stays vLLM's; `fused` decode beat
    FLA's at Kimi-Linear's shape (ITL 17.5 vs 21.8 ms in a serving A/B), so decode is kdaserve's.
    On a CPU vLLM has no KDA path: kdaserve's reference runs."""
    if device_type == "cpu":
        return False
    return phase == "prefill" and not bounded_gate


@dataclass(frozen=True)
class PluginOptions:
    prefill_backend: str = "auto"
    decode_backend: str = "auto"
    check_nan: bool = True

    def uses_vllm(self, phase: str, device_type: str, bounded_gate: bool) -> bool:
        """Does this phase run vLLM's own kernels (asked by name, or by `auto`)?"""
        name = getattr(self, f"{phase}_backend")
        return name == VLLM or (name == "auto" and auto_uses_vllm(phase, device_type, bounded_gate))

    def kdaserve_choice(self, phase: str) -> str:
        """The name handed to kdaserve's resolver (`auto` where the phase is vLLM's)."""
        name = getattr(self, f"{phase}_backend")
        return "auto" if name == VLLM else name


def plugin_options(additional_config) -> PluginOptions | None:
    """The options of this run, or None when kdaserve is not asked."""
    section = additional_config.get("kdaserve") if isinstance(additional_config, dict) else None
    env = {k: os.environ.get(v) for k, v in (("prefill_backend", ENV_PREFILL), ("decode_backend", ENV_DECODE))}
    if section is None and not any(env.values()):
        return None
    section = dict(section or {})
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        raise ValueError(f"additional_config.kdaserve has unknown keys {unknown}; expected only {list(KEYS)}")
    values = {k: section.get(k) or env[k] or "auto" for k in BACKEND_KEYS}
    bad = {k: v for k, v in values.items() if not isinstance(v, str)}
    if bad:
        raise ValueError(f"additional_config.kdaserve: backend names must be strings, got {bad}")
    check_nan = section.get("check_nan", True)
    if not isinstance(check_nan, bool):
        raise ValueError(f"additional_config.kdaserve.check_nan must be true or false, got {check_nan!r}")
    return PluginOptions(**values, check_nan=check_nan)
