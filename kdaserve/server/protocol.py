"""Request bodies of the OpenAI-compatible API, as pydantic models.

Types are strict (`"stream": "yes"`, `"max_tokens": "5"` or `"prompt": [true]` are 400s, as in
OpenAI's API; an integer is still a valid float). Unknown fields are ignored (clients and harnesses
send many we do not use: `user`, ...). Responses are plain dicts built in completions.py / chat.py:
their shape is OpenAI's and the `openai` client parses them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# vLLM's cap on top log-probs per token; OpenAI's is 5 for completions, 20 for chat.
MAX_TOP_LOGPROBS = 20
MAX_N = 16
# Stop strings are matched against every new piece of text of every stream: bounded in count and
# length (OpenAI allows 4; harnesses send a few dozen at most).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    # OpenAI's default temperature is 1.0; clients that want greedy decoding send 0.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    # vLLM's extension: each choice also carries `prompt_token_ids` and `token_ids`.
    return_token_ids: bool = False
    # Logit processors (engine/logits_processors.py); ranges are checked by SamplingParams.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    # Not built yet: a request that sets them gets a 400 saying so, never a silent 200.
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _bounded(self):
        stops = self.stop_list()
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        longest = max((len(x) for x in stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        unsupported = self.unsupported_fields()
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not supported by this server yet (structured output and tool "
                             f"calling are being built); leave them out")
        return self

    def unsupported_fields(self) -> list[str]:
        out = []
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            out.append(f"response_format of type {self.response_format.get('type')!r}")
        if self.tools:
            out.append("tools")
        if self.tool_choice not in (None, "none"):
            out.append("tool_choice")
        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                out.append(name)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _refused(self):
        # As vLLM: best_of (several samples, the best returned) and suffix (insertion) are refused.
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (vLLM refuses it too); use n for several "
                             f"completions and pick among them")
        if self.suffix:
            raise ValueError("suffix is not supported (vLLM refuses it too): completions only append to the prompt")
        return self


class ChatMessage(_Lenient):
    role: str
    # A string, or OpenAI's list of content parts ([{"type": "text", "text": ...}]).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # vLLM's field; kdaserve's tokenizers never add BOS/EOS around a text, so both values give the same.
    add_special_tokens: bool = True


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]

