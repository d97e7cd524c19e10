"""Tool-call parsers for `tool_choice` "auto" (`--enable-auto-tool-choice --tool-call-parser NAME`):
each turns a model's own tool-call format in its output tokens into OpenAI `tool_calls`, whole
(a finished completion) or as they complete (a stream). vLLM's parser names."""

from __future__ import annotations

from kdaserve.server.tool_parsers.kimi_k2 import KimiK2ToolParser

TOOL_PARSERS = {"kimi_k2": KimiK2ToolParser}


def make_tool_parser(name: str, tokenizer):
    """The parser `name` for `tokenizer`; ValueError when unknown or the tokenizer lacks its tokens."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown --tool-call-parser {name!r}; expected one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name](tokenizer)
