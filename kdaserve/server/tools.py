"""Tool calling in chat completions, in vLLM's meaning of `tool_choice`:

- "none": tools may still be shown to the model (the chat template gets them), no calls parsed.
- "required" / a named function: the output is constrained by a JSON schema (structured output;
  any model): a list of {"name", "parameters"} objects, or the named function's arguments. The
  server turns it into `tool_calls`.
- "auto" (the default with tools): the model decides; its own call format is parsed by the
  server's `--tool-call-parser` (server/tool_parsers), enabled by `--enable-auto-tool-choice`.
  Without them, a 400 that says so.

finish_reason is "tool_calls" when a choice carries calls and the model stopped by itself, except
for a named function, where OpenAI reports "stop"."""

from __future__ import annotations

import json
import uuid

from kdaserve.server.errors import bad_request
from kdaserve.server.protocol import NamedToolChoice


def _parameters(tool) -> dict:
    # A tool without parameters still takes a JSON object (vLLM's rule).
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_tool_schema(req) -> dict | None:
    """The JSON schema that tool_choice "required" or a named function imposes, else None."""
    if isinstance(req.tool_choice, NamedToolChoice):
        tool = next(t for t in req.tools if t.function.name == req.tool_choice.function.name)
        return _parameters(tool)
    if req.tool_choice != "required":
        return None
    calls = [{"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in req.tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def check_auto_tools(req, parser) -> None:
    if req.tool_choice == "auto" and parser is None:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                          '(this server has no tool-call parser); send tool_choice "required", "none" or a named function',
                          param="tool_choice")


def tool_call_id(style: str | None, name: str, index: int) -> str:
    return f"functions.{name}:{index}" if style == "kimi" else f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def forced_tool_calls(req, text: str, style: str | None) -> list[dict] | None:
    """The calls in a "required" or named-function output; None when it does not parse (cut by
    max_tokens): the text then stays the message's content."""
    if isinstance(req.tool_choice, NamedToolChoice):
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        name = req.tool_choice.function.name
        return [tool_call(tool_call_id(style, name, 0), name, text)]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [tool_call(tool_call_id(style, it["name"], i), it["name"], json.dumps(it["parameters"], ensure_ascii=False))
            for i, it in enumerate(items)]


def finish_reason(req, engine_reason: str | None, has_calls: bool) -> str | None:
    if has_calls and engine_reason == "stop" and not isinstance(req.tool_choice, NamedToolChoice):
        return "tool_calls"
    return engine_reason
