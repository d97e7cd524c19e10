"""What completions and chat completions share: parsing a body, checking the model, building
`SamplingParams`, admitting a request group, collecting or streaming its outputs as server-sent
events, and aborting when the client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response, StreamingResponse

from kdaserve.engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from kdaserve.server.engine_loop import EngineLoop, RequestGroup
from kdaserve.server.errors import APIError, bad_request, error_body, validation_message
from kdaserve.server.protocol import MAX_STOP_STRINGS, MAX_TOOLS

logger = logging.getLogger("kdaserve.server")

Model = TypeVar("Model", bound=BaseModel)
# Characters per token above which a text cannot fit the context whatever the tokenizer.
MAX_CHARS_PER_TOKEN = 64
# Seconds a stream's write may wait for a client that reads nothing before the request is aborted.
DEFAULT_STREAM_WRITE_TIMEOUT = 30.0


@dataclass
class ServerState:
    """Everything a handler needs, hung on `app.state.server`."""

    engine_loop: EngineLoop
    tokenizer: Any
    model_name: str
    model_root: str
    max_model_len: int
    request_id_headers: bool = False   # --enable-request-id-headers: a client's X-Request-Id is the response id
    # --stream-write-timeout: seconds a stream may wait on a client that reads nothing
    stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT
    # --generation-config: the checkpoint's sampling defaults (server/generation_config.py)
    sampling_defaults: dict = field(default_factory=dict)
    # --return-tokens-as-token-ids: tokens in log-probs as "token_id:{id}" (vLLM's form), which stays
    # unambiguous where several tokens decode to the same text (partial UTF-8 bytes, say)
    tokens_as_ids: bool = False
    # --enable-auto-tool-choice --tool-call-parser: the parser of tool_choice "auto" (server/tool_parsers)
    tool_parser: Any = None
    tool_call_id_style: str | None = None   # the parser's id form ("kimi": functions.{name}:{index}), else random ids
    per_request_metrics: bool = False       # --enable-per-request-metrics: timing in each response's `metrics`
    prompt_tokens_details: bool = False     # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
    # Images (a model with a vision tower): its placeholder token and processing rules, images per
    # prompt (--limit-mm-per-prompt), where their bytes may come from (server/media.py).
    image_token_id: int | None = None
    image_rules: Any = None
    max_images: int = 0
    media: Any = None
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of `text`; 400 before tokenizing when the text is so long that its tokens cannot
        fit max_model_len (a real token averages a few characters; MAX_CHARS_PER_TOKEN is far above
        any vocabulary's), so a huge prompt costs the event loop nothing."""
        self.check_chars(len(text), param)
        return list(self.tokenizer.encode(text))

    def check_chars(self, num_chars: int, param: str = "prompt") -> None:
        limit = self.max_model_len * MAX_CHARS_PER_TOKEN
        if num_chars > limit:
            raise bad_request(f"the {param} has {num_chars} characters; at most {limit} ({MAX_CHARS_PER_TOKEN} per token "
                              f"of max_model_len = {self.max_model_len}) can fit", param=param)

    def token_text(self, token_id: int) -> str:
        """One token's text, as shown in log-probs (cached: the vocabulary is fixed)."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._token_text) < 1 << 20:
                self._token_text[token_id] = text
        return text


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_and_engine_ids(state: ServerState, request: Request, prefix: str) -> tuple[str, str]:
    """(the id the client sees, the stem of the engine's request ids). With request-id headers the
    client's X-Request-Id is the response id; the engine's ids stay unique whatever clients send."""
    engine_id = new_id(prefix)
    given = request.headers.get("x-request-id") if state.request_id_headers else None
    return (given if given else engine_id), engine_id


async def parse_body(request: Request, model: type[Model], engine_loop: EngineLoop | None = None) -> Model:
    """The body as `model`: 400 for invalid JSON, JSON nested too deep to parse, strings holding a
    lone UTF-16 surrogate (they cannot be encoded as text), counts past their limits (before the
    model validates, which costs seconds for a million-entry `logit_bias`; with `engine_loop`, prompts
    x n against what it admits at once), and whatever the model refuses. Parsed in a worker thread: a
    body of many megabytes does not stall the event loop."""
    raw = await request.body()
    return await asyncio.to_thread(_parse, raw, model, engine_loop)


def _check_counts(body: dict, engine_loop: EngineLoop | None) -> None:
    """Refuse by counting, before any entry is validated."""
    for name, (limit, noun) in COUNT_LIMITS.items():
        value = body.get(name)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise bad_request(f"at most {limit} {noun} are allowed, got {len(value)}", param=name)
    prompt, n = body.get("prompt"), body.get("n", 1)
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    if engine_loop is not None:
        engine_loop.check_request_size(prompts * (n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1))


def _parse(raw: bytes, model: type[Model], engine_loop: EngineLoop | None = None) -> Model:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    _check_counts(body, engine_loop)
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("request body holds a lone UTF-16 surrogate (such as \\ud800), which is no text") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise bad_request(message, param=param) from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None


# Entries of the body's lists and maps, counted before validation (each also has its check after).
COUNT_LIMITS = {"logit_bias": (MAX_LOGIT_BIAS, "logit_bias entries"), "stop": (MAX_STOP_STRINGS, "stop strings"),
                "tools": (MAX_TOOLS, "tools"), "stop_token_ids": (MAX_STOP_TOKEN_IDS, "stop token ids")}


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in (state.model_name, state.model_root):
        raise APIError(
            404,
            f"the model `{name}` does not exist; this server serves `{state.model_name}`",
            param="model",
            code="model_not_found",
        )


def resolve_max_tokens(state: ServerState, prompt_len: int, max_tokens: int | None, *, allow_zero: bool = False) -> int:
    """The request's budget of new tokens; 400 when the prompt (plus it) passes max_model_len.
    0 (score the prompt, generate nothing) only where `allow_zero` (completions with echo)."""
    limit = state.max_model_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param="prompt")
    if prompt_len >= limit:
        # The engine samples at least one token (even to only score a prompt), so it needs room.
        raise bad_request(
            f"this model's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens; "
            f"a prompt may have at most {limit - 1}, leaving room for one output token",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - prompt_len
    lowest = 0 if allow_zero else 1
    if max_tokens < lowest:
        hint = "" if allow_zero else " (0 only with echo, to score the prompt)"
        raise bad_request(f"max_tokens must be >= {lowest}{hint}, got {max_tokens}", param="max_tokens")
    if prompt_len + max_tokens > limit:
        raise bad_request(
            f"this model's maximum context length is {limit} tokens, but {prompt_len + max_tokens} were requested "
            f"({prompt_len} in the prompt, {max_tokens} for the completion); lower max_tokens or the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def sampling_params(req, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None, choice: int,
                    defaults: dict | None = None, structured_outputs=None):
    """A request's SamplingParams; `defaults` (--generation-config) fill what it leaves out;
    `structured_outputs` (server/structured_outputs.py), compiled, shared by the n choices."""
    from kdaserve.engine.sampling_params import SamplingParams

    # With n > 1 and a seed, each choice gets its own seed so the choices differ, reproducibly.
    seed = None if req.seed is None else req.seed + choice
    d = defaults or {}

    def pick(name, server_default):
        value = getattr(req, name)
        return value if value is not None else d.get(name, server_default)

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            seed=seed,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            min_p=pick("min_p", 0.0),
            min_tokens=req.min_tokens,
            logit_bias=req.logit_bias,
            structured_outputs=structured_outputs,
            cache_salt=req.cache_salt,
            stream_interval=req.stream_interval if req.stream else None,
        )
    except (ValueError, TypeError) as exc:
        raise bad_request(f"invalid sampling parameters: {exc}") from None


def stop_holdback(stop: list[str]) -> int:
    """Characters of text to hold back while streaming: the end of the text may be the start of a
    stop string, which the engine trims from `text` only once the string is complete."""
    return max((len(s) for s in stop), default=1) - 1


def streamable_text(out, holdback: int) -> str:
    if out.finished or holdback == 0:
        return out.text
    return out.text[: max(0, len(out.text) - holdback)]


async def first_outputs(group: RequestGroup, size: int) -> list[tuple[int, Any]]:
    """Wait until every member produced a token or finished, so errors in admitting any of them
    (bad token ids...) still become an HTTP status; returns what arrived, in order, to replay."""
    seen: set[int] = set()
    buffered = []
    while len(seen) < size:
        index, out = await group.next()   # a group yields only outputs with progress
        seen.add(index)
        buffered.append((index, out))
    return buffered


async def collect_finals(group: RequestGroup, size: int) -> list[Any]:
    finals: list[Any] = [None] * size
    async for index, out in group:
        finals[index] = out
    return finals


async def run_group(
    request: Request,
    state: ServerState,
    engine_requests: list,
    *,
    stream: bool,
    events: Callable[[RequestGroup], AsyncIterator[str]],
    answer: Callable[[list], dict],
):
    """Admit the engine requests of one HTTP request and answer: an SSE stream (`events`), once
    every member has its first token, or the JSON `answer(finals)` once all finished. The group is
    aborted whenever the answer cannot complete (error, disconnect)."""
    group = state.engine_loop.open_group(engine_requests)
    try:
        if stream:
            group.replay(await unless_disconnected(request, first_outputs(group, len(engine_requests))))
            return EventStreamResponse(events(group), on_close=group.close, write_timeout=state.stream_write_timeout)
        finals = await unless_disconnected(request, collect_finals(group, len(engine_requests)))
    except ClientGone:
        group.close()
        return gone_response()
    except BaseException:
        group.close()
        raise
    group.close()
    return answer(finals)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it (and so aborting its engine requests) if the client hangs up.
    Raises `ClientGone` in that case."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _chunk_encoder() -> Callable[[Any], str]:
    """JSON text of an SSE payload, compact and not ASCII-escaped. JSONEncoder.encode builds the C
    encoder anew on every call, half the cost of a stream chunk's small dict: here the C encoder is
    built once, with JSONEncoder's own settings (the same text; a stream's chunks hold no cycles,
    so no cycle check), where the interpreter has it."""
    encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
    make = json.encoder.c_make_encoder
    if make is None:
        return encoder.encode
    c_encode = make(None, encoder.default, json.encoder.encode_basestring, None, encoder.key_separator,
                    encoder.item_separator, False, False, True)

    def encode(obj) -> str:
        return "".join(c_encode(obj, 0))

    return encode


_json = _chunk_encoder()


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else _json(data)
    return f"data: {payload}\n\n"


def response_envelope(request_id: str, obj: str, created: int, model: str, choices: list) -> dict:
    """The fields every OpenAI completion object and stream chunk starts with."""
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}


def stream_chunks(req, request_id: str, obj: str, model: str) -> Callable[..., str]:
    """chunk(choices, usage=None) -> one SSE event of a stream, every event with the same id and
    creation time; the `usage` field is on every chunk (null until the last) only when the client
    asked for it (stream_options.include_usage), as OpenAI does."""
    created = int(time.time())
    # The envelope is the same on every chunk: its JSON is written once (a stream writes one chunk
    # per step, so the encoder's work per chunk is the event loop's, times the streams).
    envelope = _json(response_envelope(request_id, obj, created, model, []))
    head = "data: " + envelope[: envelope.rindex("[]")]
    include_usage = req.include_usage

    def chunk(choices: list, usage_: dict | None = None, metrics: dict | None = None) -> str:
        tail = ',"usage":' + _json(usage_) if include_usage else ""
        if metrics:
            tail += ',"metrics":' + _json(metrics)
        return f"{head}{_json(choices)}{tail}}}\n\n"

    return chunk


def sse_error(exc: Exception) -> str:
    if isinstance(exc, APIError):
        return sse(error_body(exc.status, exc.message, param=exc.param, code=exc.code))
    return sse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"))


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends: finished, client gone
    mid-stream (Starlette cancels the body), never started, or a client that stopped reading: a
    write that cannot complete within `write_timeout` seconds (the socket's buffers are full)
    aborts the request there, frees its slots and closes the connection (uvicorn logs one line
    for the unfinished response), instead of holding them until the client reads again."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close
        self._write_timeout = write_timeout
        self.timed_out = False

    async def stream_response(self, send) -> None:
        # One watchdog per stream, not a timer per write (asyncio.timeout around each write creates
        # and cancels a timer per token of every stream): a write records when it started, and a
        # check every quarter of the timeout cancels the stream once one has waited too long. The
        # cancellation is this task's own, turned into the stall as asyncio.timeout does.
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        started: list = [None]

        async def timed_send(message) -> None:
            started[0] = loop.time()
            await send(message)
            started[0] = None

        def check() -> None:
            nonlocal watchdog
            if started[0] is not None and loop.time() - started[0] >= self._write_timeout:
                self.timed_out = True
                task.cancel()
                return
            watchdog = loop.call_later(self._write_timeout / 4, check)

        watchdog = loop.call_later(self._write_timeout / 4, check)
        try:
            await super().stream_response(timed_send)
        except asyncio.CancelledError:
            if not self.timed_out or task.uncancel() > 0:   # someone else's cancellation as well
                raise
            logger.warning("a stream's client read nothing for %.0f s: request aborted, connection closed",
                           self._write_timeout)
            self._on_close()
        finally:
            watchdog.cancel()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def gone_response() -> Response:
    # Nobody reads it; 499 is nginx's "client closed request", useful in access logs.
    return Response(status_code=499)
