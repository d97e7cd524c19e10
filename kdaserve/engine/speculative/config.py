"""`--speculative-config`: vLLM's JSON object, e.g.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

    {"method": "mtp", "num_speculative_tokens": 1}

"ngram": prompt lookup (ngram_proposer.py); "mtp": the model's multi-token-prediction layer
(GLM-5.3-Flash; mtp_proposer.py), run once per draft token. Both feed the same verify step."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kdaserve.engine.json_flag import json_object

log = logging.getLogger("kdaserve.engine")

METHODS = ("ngram", "mtp")
# vLLM's model-specific MTP method names, which it accepts as deprecated spellings of "mtp".
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp", "glm5_next_mtp", "qwen3_next_mtp", "bailing_hybrid_mtp",
               "bailing_hybrid_v3_mtp", "kimi_k3_mtp")
# vLLM's default for "mtp" is the checkpoint's num_nextn_predict_layers: 1 for GLM-5.3-Flash.
DEFAULT_MTP_TOKENS = 1
# vLLM's defaults: with neither bound given, n-grams of exactly 5 tokens; with one, both equal it.
DEFAULT_PROMPT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 16   # the verify kernels keep S+1 states per sequence; past this, memory not speed


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    @staticmethod
    def parse(value) -> "SpeculativeConfig | None":
        """From a dict, a JSON string (the flag's value) or None; a SpeculativeConfig passes through.
        Raises ValueError saying what was wrong and what is accepted."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"invalid speculative_config: unknown keys {unknown}; expected some of {sorted(known)}")
        method = value.get("method", "ngram")
        if method == "[ngram]":   # vLLM accepts this spelling too
            method = "ngram"
        if method in MTP_ALIASES:   # as vLLM does
            log.warning("speculative method %r is deprecated and replaced with 'mtp'", method)
            method = "mtp"
        if method not in METHODS:
            raise ValueError(f"invalid speculative_config method {method!r}; expected one of {list(METHODS)}")
        k = value.get("num_speculative_tokens", DEFAULT_MTP_TOKENS if method == "mtp" else None)
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"invalid speculative_config num_speculative_tokens: got {k!r}; expected an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"invalid speculative_config {name}: got {v!r}; expected an integer >= 1")
        if lo > hi:
            raise ValueError(f"invalid speculative_config: prompt_lookup_min={lo} > prompt_lookup_max={hi}; expected min <= max")
        return SpeculativeConfig(method, k, lo, hi)

    def to_dict(self) -> dict:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
