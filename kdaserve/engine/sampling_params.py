"""How to sample one request. Every field is checked when the object is built, so a bad request
fails before it reaches the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kdaserve.engine.structured_output.params import StructuredOutputsParams


def _fail(name: str, got, expected: str):
    raise ValueError(f"invalid {name}: got {got!r}; expected {expected}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


MAX_LOGIT_BIAS = 1024   # entries per request (OpenAI allows 300)
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # top-n alternatives per output token; 0 = the sampled token only
    prompt_logprobs: int | None = None
    # Logit processors, in vLLM's meaning and order (engine/logits_processors.py): min_tokens, then
    # logit_bias, then the penalties, then temperature, min_p, top-k / top-p.
    min_tokens: int = 0               # outputs before EOS and stop_token_ids may end the request
    logit_bias: dict[int, float] | None = None   # added to the logits of these token ids
    presence_penalty: float = 0.0     # subtracted once from tokens already generated
    frequency_penalty: float = 0.0    # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0   # logits of prompt and generated tokens: > 0 divided, <= 0 multiplied by it
    min_p: float = 0.0                # drop tokens below min_p times the most likely token's probability
    # A grammar the output follows (engine/structured_output); a dict is read as its fields.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's request field: mixed into the prefix cache's block hashes, so only requests with the
    # same salt share cached prefixes (tenants cannot probe each other's prompts by timing).
    cache_salt: str | None = None
    # vLLM's request field: tokens batched into each streamed output; raises the engine's
    # --stream-interval for this request (never lowers it). The first token's output and the last
    # are sent at once.
    stream_interval: int | None = None

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "an integer >= 1")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        self.temperature = float(self.temperature)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "a number in (0, 1]")
        self.top_p = float(self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", self.top_k, "an integer >= 1, or 0 / -1 for no top-k")
        # torch.Generator.manual_seed takes [-2**63, 2**64); past that it raises inside a step,
        # which would fail every request of that step.
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            _fail("seed", self.seed, "None or an integer in [-2**63, 2**64)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "a non-empty string or a list of non-empty strings")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop_token_ids, (list, tuple)) and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", f"{len(self.stop_token_ids)} ids", f"at most {MAX_STOP_TOKEN_IDS} token ids")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "True or False")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                _fail(name, v, "None or an integer >= 0 (the number of top alternatives)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if not _is_number(v) or not lo <= v <= hi:
                _fail(name, v, f"a number in [{lo}, {hi}]")
            setattr(self, name, float(v))
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            _fail("repetition_penalty", self.repetition_penalty, "a number in (0, 100] (1 = off)")
        self.repetition_penalty = float(self.repetition_penalty)
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "a number in [0, 1]")
        self.min_p = float(self.min_p)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                _fail("logit_bias", type(self.logit_bias).__name__ if not isinstance(self.logit_bias, dict) else
                      f"{len(self.logit_bias)} entries", f"a mapping of at most {MAX_LOGIT_BIAS} token ids to numbers")
            bias = {}
            for k, v in self.logit_bias.items():
                # JSON keys are strings; more than 10 digits is no token id (and int() of thousands
                # of digits fails with Python's own conversion message)
                tid = int(k) if isinstance(k, str) and k.isdigit() and len(k) <= 10 else k
                if not _is_int(tid) or tid < 0 or not _is_number(v) or not math.isfinite(v):
                    _fail("logit_bias", {k: v}, "token ids (integers >= 0) mapped to finite numbers")
                bias[tid] = min(100.0, max(-100.0, float(v)))   # OpenAI's range; vLLM clamps too
            self.logit_bias = bias or None
        if self.stream_interval is not None and (not _is_int(self.stream_interval) or self.stream_interval < 1):
            _fail("stream_interval", self.stream_interval, "None or an integer >= 1 (tokens per streamed output)")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > 1024):
            _fail("cache_salt", self.cache_salt, "None or a non-empty string of at most 1024 characters")
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - (set(StructuredOutputsParams.__dataclass_fields__) - {"compiled"}))
            if unknown:
                _fail("structured_outputs", f"fields {unknown}", "json, regex, choice, grammar, json_object, "
                      "disable_any_whitespace, disable_additional_properties")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                _fail("structured_outputs", type(self.structured_outputs).__name__, "a StructuredOutputsParams")
            if self.min_tokens:
                # Masking the end tokens while the grammar allows nothing else would leave no token to sample.
                _fail("min_tokens", self.min_tokens, "0 with structured_outputs (the grammar decides where the output ends)")

    @property
    def has_logits_processors(self) -> bool:
        """Whether anything changes the logits before sampling (beyond temperature, top-k/p)."""
        return bool(self.min_tokens or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_p)

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (vLLM's cut-off) logits / temperature can overflow to inf and the softmax to
        # NaN; the distribution is the argmax's anyway.
        return self.temperature < 1e-5 or self.top_k == 1
