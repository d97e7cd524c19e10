"""`POST /v1/chat/completions`: messages through a chat template, then generation as for completions."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from kdaserve.engine.multimodal import place_images
from kdaserve.server.chat_template import chat_prompt_ids
from kdaserve.server.completions import cached_tokens, new_logprob_entries, usage, vllm_prompt_logprobs
from kdaserve.server.errors import bad_request
from kdaserve.server.media import decode_image, image_bytes
from kdaserve.server.protocol import ChatCompletionRequest
from kdaserve.server.request_metrics import per_request_metrics
from kdaserve.server.serving import (
    ServerState,
    check_model,
    resolve_max_tokens,
    response_and_engine_ids,
    response_envelope,
    run_group,
    sampling_params,
    sse,
    sse_error,
    stop_holdback,
    stream_chunks,
    streamable_text,
)
from kdaserve.server.structured_outputs import compile_off_loop, structured_outputs_for
from kdaserve.server.tool_parsers.kimi_k2 import StreamState
from kdaserve.server.tools import (
    check_auto_tools,
    finish_reason,
    forced_tool_calls,
    forced_tool_schema,
    tool_call,
    tool_call_id,
)


def chat_logprob_entry(state: ServerState, token_id: int, entry: dict | None) -> dict:
    text = state.token_text(token_id)
    top = [
        {"token": (t := state.token_text(tid)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
        for tid, lp in ((entry or {}).get("top") or ())
    ]
    return {
        "token": text,
        "logprob": None if entry is None else entry["logprob"],
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": top,
    }


class ChatHandler:
    def __init__(self, state: ServerState):
        self.state = state

    def prompt_token_ids(self, req, images: list | None = None) -> list[int]:
        """The rendered prompt's ids; `images` (a model that takes them) collects the image parts' URLs."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        return chat_prompt_ids(self.state.tokenizer, req.messages, req.add_generation_prompt,
                               lambda text: self.state.encode(text, param="messages"),
                               lambda n: self.state.check_chars(n, param="messages"), tools=tools, images=images)

    async def _prompt_with_images(self, req) -> tuple[list[int], tuple]:
        """(prompt ids with each image's placeholder expanded, the images placed); the images'
        bytes fetched, decoded and processed off the event loop (server/media.py)."""
        state = self.state
        urls: list[str] | None = [] if state.image_token_id is not None else None
        prompt_ids = await asyncio.to_thread(self.prompt_token_ids, req, urls)
        if not urls:
            return prompt_ids, ()
        if len(urls) > state.max_images:
            raise bad_request(f"too many images: got {len(urls)}; expected at most {state.max_images} per prompt "
                              f"(--limit-mm-per-prompt '{{\"image\": N}}')", param="messages")
        data = await asyncio.gather(*(image_bytes(u, state.media, "messages") for u in urls))
        processed = await asyncio.gather(*(asyncio.to_thread(self._process, d) for d in data))
        try:
            return await asyncio.to_thread(place_images, prompt_ids, state.image_token_id, processed)
        except ValueError as exc:
            raise bad_request(f"the chat template's image placeholders do not match the images: {exc}",
                              param="messages") from None

    def _process(self, data: bytes):
        from kdaserve.models.glm5_next_images import process_image

        return process_image(decode_image(data, self.state.media, "messages"), self.state.image_rules)

    def tool_mode(self, req) -> str:
        """none, forced ("required" or a named function) or auto (the server's parser)."""
        if not req.tools or req.tool_choice == "none":
            return "none"
        return "auto" if req.tool_choice == "auto" else "forced"

    async def __call__(self, request: Request, req: ChatCompletionRequest):
        state = self.state
        check_model(state, req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.tool_mode(req) == "auto":
            check_auto_tools(req, state.tool_parser)
        structured, structured_param = structured_outputs_for(req, forced_tool_schema(req) if req.tools else None)
        # Rendering, tokenizing and compiling a grammar run in worker threads: the event loop stays
        # free for other clients.
        prompt_ids, images = await self._prompt_with_images(req)
        await compile_off_loop(state.engine_loop.engine, structured, structured_param)
        budget = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if budget is None and "max_tokens" in state.sampling_defaults:   # the checkpoint's max_new_tokens
            budget = min(state.sampling_defaults["max_tokens"], max(1, state.max_model_len - len(prompt_ids)))
        max_tokens = resolve_max_tokens(state, len(prompt_ids), budget)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        request_id, engine_id = response_and_engine_ids(state, request, "chatcmpl")
        engine_requests = [
            (
                f"{engine_id}-{j}",
                prompt_ids,
                sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs, choice=j,
                                defaults=state.sampling_defaults, structured_outputs=structured),
                False,
                images,
            )
            for j in range(req.n)
        ]
        return await run_group(
            request,
            state,
            engine_requests,
            stream=req.stream,
            events=lambda group: self._stream(req, request_id, len(prompt_ids), group),
            answer=lambda finals: self._response(req, request_id, len(prompt_ids), finals),
        )

    def _logprobs(self, token_ids, entries) -> dict:
        return {"content": [chat_logprob_entry(self.state, t, e) for t, e in zip(token_ids, entries)]}

    def _message(self, req, out) -> tuple[dict, list]:
        """The assistant message of a finished output, with its tool calls parsed per tool_choice."""
        mode, style = self.tool_mode(req), self.state.tool_call_id_style
        content, calls = out.text, []
        if mode == "forced":
            calls = forced_tool_calls(req, out.text, style) or []
            content = "" if calls else content
        elif mode == "auto":
            text, parsed = self.state.tool_parser.parse(list(out.output_token_ids))
            if parsed:
                parsed = parsed[:1] if req.parallel_tool_calls is False else parsed
                calls = [tool_call(p.id or tool_call_id(style, p.name, k), p.name, p.arguments) for k, p in enumerate(parsed)]
                content = text
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, calls

    def _response(self, req, request_id: str, num_prompt_tokens: int, finals) -> dict:
        choices = []
        for index, out in enumerate(finals):
            logprobs = None
            if req.logprobs:
                logprobs = self._logprobs(out.output_token_ids, out.logprobs or [None] * len(out.output_token_ids))
            message, calls = self._message(req, out)
            choice = {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason(req, out.finish_reason, bool(calls)),
            }
            if req.return_token_ids:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = list(out.output_token_ids)
            choices.append(choice)
        completion_tokens = sum(len(out.output_token_ids) for out in finals)
        body = response_envelope(request_id, "chat.completion", int(time.time()), self.state.model_name, choices)
        metrics = per_request_metrics(finals, self.state.per_request_metrics)
        cached = cached_tokens(self.state, finals, lambda i: 0)
        if req.prompt_logprobs is not None:   # vLLM's: once per request, beside the choices
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.state, list(finals[0].prompt_token_ids),
                                                           finals[0].prompt_logprobs)
        return {**body, "usage": usage(num_prompt_tokens, completion_tokens, cached), **({"metrics": metrics} if metrics else {})}

    async def _stream(self, req, request_id: str, num_prompt_tokens: int, group):
        size = len(group.request_ids)
        sent_chars = [0] * size
        sent_tokens = [0] * size
        started = [False] * size
        num_calls = [0] * size
        tool_states = [StreamState() for _ in range(size)]
        completion_tokens = 0
        holdback = stop_holdback(req.stop_list())
        mode, style = self.tool_mode(req), self.state.tool_call_id_style

        chunk = stream_chunks(req, request_id, "chat.completion.chunk", self.state.model_name)

        try:
            last = {}
            async for index, out in group:
                last[index] = out
                visible, calls = self._stream_step(req, mode, style, out, holdback, tool_states[index], num_calls[index])
                delta = {"content": visible[sent_chars[index] :]}
                if calls:
                    delta = {"tool_calls": [{"index": num_calls[index] + k, **c} for k, c in enumerate(calls)],
                             **({"content": delta["content"]} if delta["content"] else {})}
                    num_calls[index] += len(calls)
                if not started[index]:
                    started[index] = True
                    delta = {"role": "assistant", **delta}  # the role rides on the first token
                sent_chars[index] = max(sent_chars[index], len(visible))
                logprobs = None
                if req.logprobs:
                    logprobs = self._logprobs(out.new_token_ids, new_logprob_entries(out, sent_tokens[index]))
                sent_tokens[index] += len(out.new_token_ids)
                completion_tokens += len(out.new_token_ids)
                finish = finish_reason(req, out.finish_reason, num_calls[index] > 0) if out.finished else None
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                if req.return_token_ids:
                    choice["token_ids"] = list(out.new_token_ids)
                yield chunk([choice])
            if req.include_usage:
                yield chunk([], usage(num_prompt_tokens, completion_tokens,
                                      cached_tokens(self.state, list(last.values()), lambda i: 0)),
                            per_request_metrics(list(last.values()), self.state.per_request_metrics))
        except Exception as exc:  # noqa: BLE001 - the status line is gone; report in-band
            yield sse_error(exc)
        yield sse("[DONE]")

    def _stream_step(self, req, mode: str, style, out, holdback: int, state: StreamState, calls_so_far: int):
        """(the content text visible so far, the tool calls completed by this update). Forced
        calls are one JSON document: sent whole when the output finishes (as content if it does
        not parse); auto calls as the parser sees each one close."""
        visible = streamable_text(out, holdback)
        if mode == "forced":
            if not out.finished:
                return "", []
            calls = forced_tool_calls(req, out.text, style)
            return ("", calls) if calls else (out.text, [])
        if mode == "auto":
            visible, parsed = self.state.tool_parser.stream(state, list(out.new_token_ids), visible, out.finished)
            if req.parallel_tool_calls is False:
                parsed = parsed[: max(0, 1 - calls_so_far)]
            return visible, [tool_call(p.id or tool_call_id(style, p.name, calls_so_far + k), p.name, p.arguments)
                             for k, p in enumerate(parsed)]
        return visible, []
