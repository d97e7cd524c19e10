"""Request bodies of the OpenAI-compatible API, as pydantic models.

Types are strict (`"stream": "yes"`, `"max_tokens": "5"` or `"prompt": [true]` are 400s, as in
OpenAI's API; an integer is still a valid float). Unknown fields are ignored (clients and harnesses
send many we do not use: `user`, ...). Responses are plain dicts built in completions.py / chat.py:
their shape is OpenAI's and the `openai` client parses them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# vLLM's cap on top log-probs per token; OpenAI's is 5 for completions, 20 for chat.
MAX_TOP_LOGPROBS = 20
MAX_N = 16
# Stop strings are matched against every new piece of text of every stream: bounded in count and
# length (OpenAI allows 4; harnesses send a few dozen at most).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_TOOLS = 128   # OpenAI's limit


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema: the field is named json_schema, read as "schema".
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _complete(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema (the JSON schema)")
        if self.type == "structural_tag":
            raise ValueError("response_format of type structural_tag is not supported; use json_schema, json_object, "
                             "or structured_outputs (json, regex, choice, grammar)")
        return self


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
    # vLLM's: only requests with the same salt share prefix-cache entries.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # vLLM's: tokens batched into each streamed chunk; raises the server's --stream-interval for
    # this request (values below it count as it); the first and last chunks go at once. Ignored
    # without `stream`.
    stream_interval: int | None = Field(default=None, ge=1)
    # vLLM's: the prompt tokens' log-probs with this many alternatives each, answered as vLLM's
    # `prompt_logprobs` list (completions: per choice; chat: top-level). Not with `stream`.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available with stream (vLLM refuses it too); send the request "
                             "without stream")
        return self
    # Structured output (server/structured_outputs.py): OpenAI's response_format or vLLM's
    # structured_outputs (json, regex, choice, grammar, json_object); checked by the engine.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's old names, gone from vLLM too: a 400 that names the replacement, never ignored.
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
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is no longer supported (vLLM removed it too); send structured_outputs="
                                 f"{{\"{name.removeprefix('guided_')}\": ...}} instead")
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs is not None:
            raise ValueError("response_format and structured_outputs both constrain the output; send one of them")
        return self

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
    # Chat-only fields, refused here rather than ignored.
    tools: Any = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _refused(self):
        # As vLLM: best_of (several samples, the best returned) and suffix (insertion) are refused.
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (vLLM refuses it too); use n for several "
                             f"completions and pick among them")
        if self.suffix:
            raise ValueError("suffix is not supported (vLLM refuses it too): completions only append to the prompt")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools and tool_choice belong to /v1/chat/completions; completions have no tool calls")
        return self


class FunctionCall(_Lenient):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: str
    # A string, or OpenAI's list of content parts ([{"type": "text", "text": ...}]).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant turn's calls
    tool_call_id: str | None = None            # a tool turn: the call it answers


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of the arguments
    strict: bool | None = None


class ChatTool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    # Tool calling (server/tools.py). tool_choice defaults to "auto" with tools, "none" without.
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice(self):
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        if self.tool_choice != "none" and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice if isinstance(self.tool_choice, str) else 'naming a function'} "
                             f"needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not in "
                                 f"tools ({', '.join(names)})")
        if len({t.function.name for t in self.tools or ()}) != len(self.tools or ()):
            raise ValueError("tools must have distinct function names")
        if self.tool_choice != "none" and (self.response_format is not None and self.response_format.type != "text"
                                           or self.structured_outputs is not None):
            raise ValueError("tool calls and response_format / structured_outputs both constrain the output; send "
                             "tool_choice \"none\" or leave the format out")
        return self


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

