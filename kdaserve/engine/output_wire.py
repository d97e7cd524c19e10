"""Request outputs across the engine process's pipe: each step sends only what it added.

A `RequestOutput` holds everything so far (all output ids, log-probs, the text); pickling it whole
every step would cost O(length) per request per step. The engine process encodes what is new since
the last output of the same request; the API process keeps each request's lists and text and
rebuilds outputs equal to the engine's own (`RequestOutput.__eq__`).

The engine's per-request lists only grow by append (outputs.ListPrefix); the text may shrink once,
when a stop string completes and is trimmed, so it travels as (length kept, new tail). A request's
metrics dict travels only when the engine made a new one (OutputProcessor._metrics keeps one until it
changes); None means "as before".

The engine process makes text only for requests with stop strings (OutputProcessor.detokenize off): the
others' outputs have text None, sent as "kept None", and the decoder detokenizes their tokens here,
with the engine's own detokenizer and its rules (a stop token's text left out, the text held back
at the end flushed when the request ends by length or stop, not when aborted), so the outputs are
the ones an engine that makes all text would give.
"""

from __future__ import annotations

from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.outputs import ListPrefix, RequestOutput

NO_TEXT = None   # "kept" of an output the engine made no text for: the decoder detokenizes it


def _tail(value, start: int) -> list:
    """`value[start:]` for a list or a ListPrefix snapshot, copying only the tail."""
    if type(value) is ListPrefix:
        return value.source[value.start + start : value.stop]
    return value[start:]


class OutputEncoder:
    """In the engine process: one wire tuple per output, the delta since that request's last."""

    def __init__(self):
        # request id -> [output ids, log-probs, prompt log-probs, text, the metrics dict sent last]
        self._sent: dict[str, list] = {}

    def encode(self, out: RequestOutput) -> tuple:
        sent = self._sent.get(out.request_id)
        if sent is None:
            sent = self._sent[out.request_id] = [0, 0, 0, "", None]
        ids = _tail(out._output_token_ids, sent[0])
        sent[0] += len(ids)
        logprobs = None if out._logprobs is None else _tail(out._logprobs, sent[1])
        if logprobs is not None:
            sent[1] += len(logprobs)
        prompt_logprobs = None if out._prompt_logprobs is None else _tail(out._prompt_logprobs, sent[2])
        if prompt_logprobs is not None:
            sent[2] += len(prompt_logprobs)
        text, before = out.text, sent[3]
        if text is None:
            keep = tail = NO_TEXT
        else:
            keep = len(before) if text.startswith(before) else 0
            tail = text[keep:]
            sent[3] = text
        # The engine hands the same metrics dict to a request's outputs until it changes (OutputProcessor._metrics).
        metrics = out.metrics
        if metrics is sent[4]:
            metrics = None
        else:
            sent[4] = metrics
        if out.finished:
            del self._sent[out.request_id]
        return (out.request_id, ids, out.new_token_ids, keep, tail, out.finished, out.finish_reason,
                logprobs, prompt_logprobs, out.num_prompt_tokens, out.num_output_tokens, metrics)


class OutputDecoder:
    """In the API process: rebuilds full outputs from the deltas; `begin` when a request is sent,
    `forget` when the API process stops listening to it (finished outputs forget themselves).
    `tokenizer`: the engine's, for the outputs it sends without text."""

    def __init__(self, tokenizer=None):
        self._tokenizer = tokenizer
        # request id -> [prompt ids, output ids, log-probs, prompt log-probs, text, detokenizer or None,
        # metrics]
        self._acc: dict[str, list] = {}

    def begin(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._acc[request_id] = [prompt_token_ids, [], None, None, "", None, {}]

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
        if keep is NO_TEXT:
            acc[4] = self._detokenize(request_id, acc, len(ids), finished, reason)
        else:
            acc[4] = acc[4][:keep] + tail if keep < len(acc[4]) else acc[4] + tail
        if metrics is None:   # as in the request's output before
            metrics = acc[6]
        else:
            acc[6] = metrics
        if finished:
            del self._acc[request_id]
        return RequestOutput(request_id, acc[0], ListPrefix(acc[1]), new_ids, acc[4], finished, reason,
                             ListPrefix(acc[2]) if acc[2] is not None else None,
                             ListPrefix(acc[3]) if acc[3] is not None else None,
                             num_prompt, num_output, metrics)

    def _detokenize(self, request_id: str, acc: list, num_new: int, finished: bool, reason: str | None) -> str:
        """The text of an output the engine made none for, as OutputProcessor._append_token makes it:
        token by token (several tokens in one decode would hold back all of their text when the
        last of them ends inside a character), the end flushed when the request ends by length
        or stop, not when aborted, and a "stop" token's own text left out (without stop strings a
        "stop" is a stop token: end of sequence, stop_token_ids, the grammar's end)."""
        detok = acc[5]
        if detok is None:
            if self._tokenizer is None:
                raise ValueError(f"request {request_id!r}: its output came without text (the engine leaves it to the "
                                 f"receiver) but this OutputDecoder has no tokenizer; build it with the engine's: "
                                 f"OutputDecoder(tokenizer)")
            detok = acc[5] = IncrementalDetokenizer(self._tokenizer, [])
        ids = acc[1]
        final = finished and reason != "abort"
        last = len(ids) - 1 if finished and reason == "stop" else len(ids)
        ends = list(range(len(ids) - num_new + 1, last + 1))
        if final and not ends:   # only the stop token is new: the flush alone
            ends = [last]
        for end in ends:
            detok.add(ids, final=final and end == last, end=end, check_stop=False)
        return detok.text
