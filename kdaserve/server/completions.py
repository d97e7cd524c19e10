"""`POST /v1/completions`: prompts as text or token ids, echo, log-probs, stop strings, streaming."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import Request

from kdaserve.server.errors import bad_request
from kdaserve.server.protocol import CompletionRequest
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


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # the caller's text, or None for token ids (decoded only if echoed)


def normalize_prompts(state: ServerState, prompt) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(Prompt(state.encode(item), item))
        else:
            prompts.append(Prompt(list(item), None))
    return prompts


class ChoiceLogprobs:
    """OpenAI's completion log-probs: parallel lists tokens / token_logprobs / top_logprobs /
    text_offset, where offsets count characters from the start of the choice's text."""

    def __init__(self, state: ServerState, offset: int = 0):
        self.state = state
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, entry: dict | None) -> None:
        text = self.state.token_text(token_id)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        if entry is None:  # the first prompt token has no log-prob
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(entry["logprob"])
        self.top_logprobs.append(self._top(token_id, text, entry))

    def _top(self, token_id: int, text: str, entry: dict) -> dict[str, float]:
        """The alternatives keyed by text, the chosen token always among them (as vLLM lists it
        even outside the top n) with exactly its token_logprobs value. Texts are keys, and several
        tokens can decode to the same text: the chosen token keeps its text, any other token whose
        text is taken is keyed "token_id:{id}", so no alternative is lost."""
        items, taken, listed = [], {text}, False
        for tid, lp in entry.get("top") or ():   # in rank order
            if tid == token_id:
                items.append((text, entry["logprob"]))
                listed = True
                continue
            key = self.state.token_text(tid)
            key = key if key not in taken else f"token_id:{tid}"
            taken.add(key)
            items.append((key, lp))
        if not listed:
            items.append((text, entry["logprob"]))
        return dict(items)

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def prompt_logprobs_into(lp: ChoiceLogprobs, token_ids: list[int], entries) -> None:
    entries = entries or [None] * len(token_ids)
    for token_id, entry in zip(token_ids, entries):
        lp.add(token_id, entry)


def vllm_prompt_logprobs(state, token_ids: list[int], entries) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per prompt token a dict from token
    id to {"logprob", "rank", "decoded_token"}: the token itself and the top alternatives."""
    out: list[dict | None] = [None]
    for token_id, entry in zip(token_ids[1:], list(entries or [])[1:]):
        if entry is None:
            out.append(None)
            continue
        row = {str(tid): {"logprob": lp, "rank": rank + 1, "decoded_token": state.token_text(tid)}
               for rank, (tid, lp) in enumerate(entry["top"])}
        row[str(token_id)] = {"logprob": entry["logprob"], "rank": entry.get("rank"),
                              "decoded_token": state.token_text(token_id)}
        out.append(row)
    return out


def _top_cut(entries, k: int):
    """Entries with their alternatives cut to `k` (the engine computed max(logprobs, prompt_logprobs))."""
    return [None if e is None else {**e, "top": e["top"][:k]} for e in entries or []]


def new_logprob_entries(out, num_sent: int) -> list:
    """The log-prob entries of this output's new tokens (the engine reports all so far)."""
    if out.logprobs is None:
        return [None] * len(out.new_token_ids)
    if len(out.logprobs) == len(out.output_token_ids):
        return out.logprobs[num_sent : num_sent + len(out.new_token_ids)]
    return list(out.logprobs)[-len(out.new_token_ids) :] if out.new_token_ids else []


@dataclass
class Choice:
    """One engine request of a completion: which prompt it answers, and whether it only scores
    the prompt (`max_tokens: 0` with echo: the engine still samples one token, which is hidden)."""

    prompt: Prompt
    echo_text: str
    score_only: bool


class CompletionHandler:
    def __init__(self, state: ServerState):
        self.state = state

    async def __call__(self, request: Request, req: CompletionRequest):
        state = self.state
        check_model(state, req.model)
        # Tokenizing (up to max_model_len x 64 characters) runs in a worker thread: the loop stays free.
        prompts = await asyncio.to_thread(normalize_prompts, state, req.prompt)
        structured, structured_param = structured_outputs_for(req)
        await compile_off_loop(state.engine_loop.engine, structured, structured_param)
        wants_prompt_logprobs = req.echo and req.logprobs is not None or req.prompt_logprobs is not None
        prompt_top = max(req.logprobs if req.echo and req.logprobs is not None else 0, req.prompt_logprobs or 0)
        request_id, engine_id = response_and_engine_ids(state, request, "cmpl")
        choices: list[Choice] = []
        engine_requests = []
        for i, prompt in enumerate(prompts):
            budget = req.max_tokens
            if "max_tokens" not in req.model_fields_set and "max_tokens" in state.sampling_defaults:
                budget = min(state.sampling_defaults["max_tokens"], max(1, state.max_model_len - len(prompt.token_ids)))
            max_tokens = resolve_max_tokens(state, len(prompt.token_ids), budget, allow_zero=req.echo)
            echo_text = self._echo_text(prompt) if req.echo else ""
            for j in range(req.n):
                params = sampling_params(
                    req,
                    max_tokens=max(max_tokens, 1),
                    logprobs=req.logprobs,
                    prompt_logprobs=prompt_top if wants_prompt_logprobs else None,
                    choice=j,
                    defaults=state.sampling_defaults,
                    structured_outputs=structured,
                )
                choices.append(Choice(prompt, echo_text, score_only=max_tokens == 0))
                engine_requests.append((f"{engine_id}-{i}-{j}", prompt.token_ids, params, max_tokens == 0))

        return await run_group(
            request,
            state,
            engine_requests,
            stream=req.stream,
            events=lambda group: self._stream(req, request_id, prompts, choices, group),
            answer=lambda finals: self._response(req, request_id, prompts, choices, finals),
        )

    def _echo_text(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.state.tokenizer.decode(prompt.token_ids)

    def _response(self, req, request_id, prompts, choices: list[Choice], finals) -> dict:
        body_choices = []
        completion_tokens = 0
        for index, (choice, out) in enumerate(zip(choices, finals)):
            output_ids = [] if choice.score_only else list(out.output_token_ids)
            text = "" if choice.score_only else out.text
            logprobs = None
            if req.logprobs is not None:
                lp = ChoiceLogprobs(self.state)
                if req.echo:
                    prompt_logprobs_into(lp, choice.prompt.token_ids, _top_cut(out.prompt_logprobs, req.logprobs))
                for token_id, entry in zip(output_ids, all_logprob_entries(out)):
                    lp.add(token_id, entry)
                logprobs = lp.as_dict()
            completion_tokens += len(output_ids)
            body = {
                "index": index,
                "text": choice.echo_text + text,
                "logprobs": logprobs,
                "finish_reason": "length" if choice.score_only else out.finish_reason,
            }
            if req.return_token_ids:
                body["prompt_token_ids"] = choice.prompt.token_ids
                body["token_ids"] = output_ids
            if req.prompt_logprobs is not None:
                body["prompt_logprobs"] = vllm_prompt_logprobs(self.state, choice.prompt.token_ids,
                                                               _top_cut(out.prompt_logprobs, req.prompt_logprobs))
            body_choices.append(body)
        body = response_envelope(request_id, "text_completion", int(time.time()), self.state.model_name, body_choices)
        metrics = per_request_metrics(finals, self.state.per_request_metrics)
        cached = cached_tokens(self.state, finals, lambda i: id(choices[i].prompt))
        return {**body, "usage": usage(sum(len(p.token_ids) for p in prompts), completion_tokens, cached),
                **({"metrics": metrics} if metrics else {})}

    async def _stream(self, req, request_id, prompts, choices: list[Choice], group):
        size = len(choices)
        started = [False] * size
        sent_chars = [0] * size
        sent_tokens = [0] * size
        offsets = [0] * size
        completion_tokens = 0
        holdback = stop_holdback(req.stop_list())

        chunk = stream_chunks(req, request_id, "text_completion", self.state.model_name)

        try:
            last = {}
            async for index, out in group:
                last[index] = out
                choice = choices[index]
                if choice.score_only:
                    text, new_ids, entries = "", [], []
                else:
                    visible = streamable_text(out, holdback)
                    text = visible[sent_chars[index] :]
                    sent_chars[index] = max(sent_chars[index], len(visible))
                    new_ids = list(out.new_token_ids)
                    entries = new_logprob_entries(out, sent_tokens[index])
                lp = ChoiceLogprobs(self.state, offsets[index]) if req.logprobs is not None else None
                if not started[index]:
                    started[index] = True
                    if req.echo:
                        text = choice.echo_text + text
                        if lp is not None:
                            prompt_logprobs_into(lp, choice.prompt.token_ids, _top_cut(out.prompt_logprobs, req.logprobs))
                if lp is not None:
                    for token_id, entry in zip(new_ids, entries):
                        lp.add(token_id, entry)
                    offsets[index] = lp.offset
                sent_tokens[index] += len(out.new_token_ids)
                completion_tokens += len(new_ids)
                finish = None
                if out.finished:
                    finish = "length" if choice.score_only else out.finish_reason
                body = {"index": index, "text": text, "logprobs": lp.as_dict() if lp is not None else None,
                        "finish_reason": finish}
                if req.return_token_ids:
                    body["token_ids"] = new_ids
                yield chunk([body])
            if req.include_usage:
                cached = cached_tokens(self.state, [last.get(i) for i in range(len(choices))], lambda i: id(choices[i].prompt))
                yield chunk([], usage(sum(len(p.token_ids) for p in prompts), completion_tokens, cached),
                            per_request_metrics(list(last.values()), self.state.per_request_metrics))
        except Exception as exc:  # noqa: BLE001 - the status line is gone; report in-band
            yield sse_error(exc)
        yield sse("[DONE]")


def all_logprob_entries(out) -> list:
    if out.logprobs is None:
        return [None] * len(out.output_token_ids)
    return list(out.logprobs)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; with `cached_tokens` (--enable-prompt-tokens-details) also the prompt tokens
    the prefix cache held."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def cached_tokens(state, outs, prompt_of) -> int | None:
    """Prompt tokens served from the prefix cache, each prompt counted once (its n choices share
    it: the most any of them found); None unless --enable-prompt-tokens-details."""
    if not state.prompt_tokens_details:
        return None
    best: dict = {}
    for i, out in enumerate(outs):
        if out is not None:
            key = prompt_of(i)
            best[key] = max(best.get(key, 0), out.metrics.get("num_cached_tokens", 0))
    return sum(best.values())
