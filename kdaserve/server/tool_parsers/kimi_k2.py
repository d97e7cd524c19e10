"""Kimi's tool-call format (Kimi-K2, Kimi-Linear), made of special tokens:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Tokyo"}<|tool_call_end|><|tool_call_begin|>...<|tool_calls_section_end|>

The header is the call's id ("functions.{name}:{index}"), which the chat template writes back
when the call is part of the history. Parsed on token ids (the markers are single tokens, so
text that merely spells a marker is never taken for one); text before the section is the
message's content."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_ID = re.compile(r".+:\d+")


@dataclass
class ParsedCall:
    id: str | None      # the model's id when it wrote one in Kimi's form
    name: str
    arguments: str      # JSON text as the model wrote it ("{}" when empty)


@dataclass
class StreamState:
    ids: list[int] = field(default_factory=list)
    section_at: int | None = None    # index of the section's first token in ids
    content: str = ""                # the text before the section, once it started
    scanned: int = 0                 # ids before this index hold no unreported complete call
    num_calls: int = 0


class KimiK2ToolParser:
    name = "kimi_k2"
    tool_call_id_style = "kimi"   # ids of forced calls too: "functions.{name}:{index}"

    def __init__(self, tokenizer):
        lookup = getattr(tokenizer, "token_to_id", None)
        ids = {m: lookup(m) if lookup else None for m in (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)}
        missing = [m for m, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"--tool-call-parser kimi_k2 needs Kimi's tool-call tokens, and this model's tokenizer lacks "
                             f"{', '.join(missing)}")
        self.tokenizer = tokenizer
        self.section_begin, self.section_end = ids[SECTION_BEGIN], ids[SECTION_END]
        self.call_begin, self.arg_begin, self.call_end = ids[CALL_BEGIN], ids[ARG_BEGIN], ids[CALL_END]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _call(self, header_ids: list[int], arg_ids: list[int]) -> ParsedCall:
        header = self._decode(header_ids).strip()
        tool_id = header if _ID.fullmatch(header) else None
        name = header.rsplit(":", 1)[0] if tool_id else header
        return ParsedCall(tool_id, name.removeprefix("functions."), self._decode(arg_ids).strip() or "{}")

    def _complete_calls(self, ids: list[int], start: int) -> tuple[list[ParsedCall], int]:
        """Calls closed in ids[start:] and the index after the last of them."""
        calls, i = [], start
        while True:
            try:
                b = ids.index(self.call_begin, i)
                e = ids.index(self.call_end, b)
            except ValueError:
                return calls, i
            inner = ids[b + 1 : e]
            a = inner.index(self.arg_begin) if self.arg_begin in inner else len(inner)
            calls.append(self._call(inner[:a], inner[a + 1 :]))
            i = e + 1

    def parse(self, ids: list[int]) -> tuple[str | None, list[ParsedCall]]:
        """A finished output: (content, calls). Without a complete call, all of it is content."""
        if self.section_begin not in ids:
            return self._decode(ids), []
        at = ids.index(self.section_begin)
        calls, _ = self._complete_calls(ids, at + 1)
        if not calls:
            return self._decode(ids), []
        return self._decode(ids[:at]) or None, calls

    def stream(self, state: StreamState, new_ids: list[int], text_so_far: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        """A stream's next step: the content visible so far (`text_so_far`, the output's text,
        until the section starts) and the calls completed by `new_ids`. A section that ends
        without a complete call gives its text back as content when the output finishes."""
        start = len(state.ids)
        state.ids.extend(new_ids)
        if state.section_at is None and self.section_begin in new_ids:
            state.section_at = start + new_ids.index(self.section_begin)
            state.scanned = state.section_at + 1
            state.content = self._decode(state.ids[: state.section_at])
        if state.section_at is None:
            return text_so_far, []
        calls, state.scanned = self._complete_calls(state.ids, state.scanned)
        state.num_calls += len(calls)
        if finished and state.num_calls == 0:
            return self._decode(state.ids), []
        return state.content, calls
