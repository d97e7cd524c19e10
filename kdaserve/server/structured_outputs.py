"""A request's output constraint: OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs`, or the schema that `tool_choice` "required" or a named tool implies
(server/tools.py), as one `StructuredOutputsParams`; compiled in a worker thread before the
request reaches the engine, so a large schema never stalls the event loop or the engine's steps.
The engine caches compiled grammars by their source."""

from __future__ import annotations

import asyncio

from kdaserve.engine.structured_output.params import StructuredOutputsParams
from kdaserve.server.errors import bad_request


def structured_outputs_for(req, tool_schema: dict | None = None) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint `req` asks for (400 for an invalid one) or None, and the request field it
    came from (the `param` of errors about it)."""
    rf = getattr(req, "response_format", None)
    if tool_schema is not None:
        fields, param = {"json": tool_schema}, "tools"
    elif rf is not None and rf.type == "json_object":
        fields, param = {"json_object": True}, "response_format"
    elif rf is not None and rf.type == "json_schema":
        fields, param = {"json": rf.json_schema.json_schema}, "response_format"
    elif req.structured_outputs is not None:
        fields, param = dict(req.structured_outputs), "structured_outputs"
        allowed = set(StructuredOutputsParams.__dataclass_fields__) - {"compiled"}
        unknown = sorted(set(fields) - allowed)
        if unknown:
            raise bad_request(f"structured_outputs has unknown fields {unknown}; expected some of {sorted(allowed)}",
                              param=param)
    else:
        return None, ""
    try:
        return StructuredOutputsParams(**fields), param
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param=param) from None


async def compile_off_loop(engine, params: StructuredOutputsParams | None, param: str) -> None:
    """Compile `params` (kept on it) in a worker thread; 400 naming what is wrong with it."""
    if params is None:
        return
    try:
        await asyncio.to_thread(engine.compile_grammar, params)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None
