"""What the engine reports for a request after each step it progressed in."""

from __future__ import annotations


class ListPrefix:
    """`source[start:stop]`, copied only when read. The engine's per-request lists (token ids,
    log-probs, prompt log-probs) only ever grow by append, so the slice taken later is the list as
    it was when the output was made: a snapshot at O(1) per step instead of a copy of everything
    so far (O(length) per step, quadratic over a long generation)."""

    __slots__ = ("source", "start", "stop")

    def __init__(self, source: list, start: int = 0, stop: int | None = None):
        self.source, self.start = source, start
        self.stop = len(source) if stop is None else stop

    def materialize(self) -> list:
        return self.source[self.start : self.stop]


def _lazy(name: str, doc: str) -> property:
    slot = "_" + name

    def get(self):
        value = getattr(self, slot)
        if type(value) is ListPrefix:
            value = value.materialize()
            setattr(self, slot, value)
        return value

    def set(self, value) -> None:
        setattr(self, slot, value)

    return property(get, set, doc=doc)


class RequestOutput:
    """A request's state after a step. `output_token_ids`, `logprobs` and `prompt_logprobs` may be
    given as ListPrefix snapshots; reading them gives plain lists."""

    __slots__ = ("request_id", "prompt_token_ids", "_output_token_ids", "new_token_ids", "text", "finished",
                 "finish_reason", "_logprobs", "_prompt_logprobs", "num_prompt_tokens", "num_output_tokens", "metrics")

    output_token_ids = _lazy("output_token_ids", "all output tokens so far")
    logprobs = _lazy("logprobs", 'per output token: {"token_id", "logprob", "top": [(token_id, logprob), ...]}, or None')
    prompt_logprobs = _lazy("prompt_logprobs", 'per prompt token (the first is None): {"token_id", "logprob", "top", "rank"}, '
                                               'or None')

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int] | ListPrefix,
        new_token_ids: list[int],              # this step
        text: str | None,                      # all output text so far, stop strings trimmed; None:
                                               # not made (OutputProcessor.detokenize off), the receiver's to make
        finished: bool,
        finish_reason: str | None = None,      # "stop" | "length" | "abort" | None
        logprobs: list[dict] | ListPrefix | None = None,
        prompt_logprobs: list[dict | None] | ListPrefix | None = None,
        num_prompt_tokens: int = 0,
        num_output_tokens: int = 0,
        metrics: dict | None = None,           # arrival/first-token/finish times (time.monotonic)
    ):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self._output_token_ids, self.new_token_ids, self.text = output_token_ids, new_token_ids, text
        self.finished, self.finish_reason = finished, finish_reason
        self._logprobs, self._prompt_logprobs = logprobs, prompt_logprobs
        self.num_prompt_tokens, self.num_output_tokens = num_prompt_tokens, num_output_tokens
        self.metrics = {} if metrics is None else metrics

    _FIELDS = ("request_id", "prompt_token_ids", "output_token_ids", "new_token_ids", "text", "finished",
               "finish_reason", "logprobs", "prompt_logprobs", "num_prompt_tokens", "num_output_tokens", "metrics")

    def __eq__(self, other) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self._FIELDS)

    __hash__ = None

    def __repr__(self) -> str:
        return "RequestOutput(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in self._FIELDS) + ")"
