"""Request outputs across the engine process's pipe: each step sends only what it added.

A `RequestOutput` holds everything so far (all output ids, log-probs, the text); pickling it whole
every step would cost O(length) per request per step. The engine process encodes what is new since
the last output of the same request; the API process keeps each request's lists and text and
rebuilds outputs equal to the engine's own (`RequestOutput.__eq__`).

The engine's per-request lists only grow by append (outputs.ListPrefix); the text may shrink once,
when a stop string completes and is trimmed, so it travels as (length kept, new tail).
"""

from __future__ import annotations

from kdaserve.engine.outputs import ListPrefix, RequestOutput


def _tail(value, start: int) -> list:
    """`value[start:]` for a list or a ListPrefix snapshot, copying only the tail."""
    if type(value) is ListPrefix:
        return value.source[value.start + start : value.stop]
    return value[start:]


class OutputEncoder:
    """In the engine process: one wire tuple per output, the delta since that request's last."""

    def __init__(self):
        self._sent: dict[str, list] = {}   # request id -> [output ids, log-probs, prompt log-probs, text]

    def encode(self, out: RequestOutput) -> tuple:
        sent = self._sent.get(out.request_id)
        if sent is None:
            sent = self._sent[out.request_id] = [0, 0, 0, ""]
        ids = _tail(out._output_token_ids, sent[0])
        sent[0] += len(ids)
        logprobs = None if out._logprobs is None else _tail(out._logprobs, sent[1])
        if logprobs is not None:
            sent[1] += len(logprobs)
        prompt_logprobs = None if out._prompt_logprobs is None else _tail(out._prompt_logprobs, sent[2])
        if prompt_logprobs is not None:
            sent[2] += len(prompt_logprobs)
        text, before = out.text, sent[3]
        keep = len(before) if text.startswith(before) else 0
        sent[3] = text
        if out.finished:
            del self._sent[out.request_id]
        return (out.request_id, ids, out.new_token_ids, keep, text[keep:], out.finished, out.finish_reason,
                logprobs, prompt_logprobs, out.num_prompt_tokens, out.num_output_tokens, out.metrics)


class OutputDecoder:
    """In the API process: rebuilds full outputs from the deltas; `begin` when a request is sent,
    `forget` when the API process stops listening to it (finished outputs forget themselves)."""

    def __init__(self):
        self._acc: dict[str, list] = {}   # request id -> [prompt ids, output ids, log-probs, prompt log-probs, text]

    def begin(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._acc[request_id] = [prompt_token_ids, [], None, None, ""]

    def forget(self, request_id: str) -> None:
        self._acc.pop(request_id, None)

    def decode(self, wire: tuple) -> RequestOutput | None:
        """The full output, or None for a request not begun (or forgotten)."""
        (request_id, ids, new_ids, keep, tail, finished, reason, logprobs, prompt_logprobs,
         num_prompt, num_output, metrics) = wire
        acc = self._acc.get(request_id)
        if acc is None:
            return None
        acc[1].extend(ids)
        for slot, delta in ((2, logprobs), (3, prompt_logprobs)):
            if delta is not None:
                if acc[slot] is None:
                    acc[slot] = []
                acc[slot].extend(delta)
        acc[4] = acc[4][:keep] + tail if keep < len(acc[4]) else acc[4] + tail
        if finished:
            del self._acc[request_id]
        return RequestOutput(request_id, acc[0], ListPrefix(acc[1]), new_ids, acc[4], finished, reason,
                             ListPrefix(acc[2]) if acc[2] is not None else None,
                             ListPrefix(acc[3]) if acc[3] is not None else None,
                             num_prompt, num_output, metrics)
