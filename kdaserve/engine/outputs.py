"""What the engine reports for a request after each step it progressed in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]              # all so far
    new_token_ids: list[int]                 # this step
    text: str                                # all output text so far, stop strings trimmed
    finished: bool
    finish_reason: str | None = None         # "stop" | "length" | "abort" | None
    # per output token: {"token_id", "logprob", "top": [(token_id, logprob), ...]}
    logprobs: list[dict] | None = None
    # per prompt token (the first is None): {"token_id", "logprob", "top": [...]}
    prompt_logprobs: list[dict | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    metrics: dict = field(default_factory=dict)   # arrival/first-token/finish times (time.monotonic)
