"""Structured output and tool calls through the HTTP API (the session's `tiny` server): outputs
parse against their schema, forced tool calls come back as `tool_calls`, and every bad
constraint is a 400 that names its field."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")

from server_helpers import sse_events

# The random model likes whitespace, which JSON allows anywhere: these biases keep outputs short.
NO_SPACE = {"9": -100, "10": -100, "13": -100, "32": -100}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"type": "string", "enum": ["red", "green"]}},
          "required": ["ok", "color"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop"}},
]


def chat(**body) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 120,
            "logit_bias": NO_SPACE, **body}


def _schema_ok(obj) -> bool:
    return isinstance(obj, dict) and set(obj) == {"ok",
                                                  "color"} and isinstance(obj["ok"], bool) and obj["color"] in ("red", "green")


def test_response_format_json_schema(client):
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}, n=2,
                temperature=0.8, seed=3)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        assert _schema_ok(json.loads(choice["message"]["content"]))


def test_response_format_json_object_on_completions(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 0, "max_tokens": 200,
                                             "logit_bias": NO_SPACE, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)


@pytest.mark.parametrize("spec, ok", [
    ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"regex": "[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
    ({"json": SCHEMA, "disable_any_whitespace": True}, lambda t: _schema_ok(json.loads(t)) and " " not in t),
])
def test_structured_outputs_field(client, spec, ok):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "bb"], "temperature": 0, "max_tokens": 60,
                                             "structured_outputs": spec})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop" and ok(choice["text"]), choice


def test_streamed_structured_output_parses(client):
    events = sse_events(client, "/v1/chat/completions", chat(stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e != "[DONE]")
    assert _schema_ok(json.loads(text))


@pytest.mark.parametrize("body, param, message", [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "invalid structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs", "Unsupported type"),
    ({"structured_outputs": {"regx": "a"}}, "structured_outputs", "unknown fields ['regx']"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, None, "min_tokens"),
    ({"response_format": {"type": "json_schema"}}, None, "json_schema.schema"),
    ({"response_format": {"type": "structural_tag"}}, None, "structural_tag is not supported"),
    ({"response_format": {"type": "yaml"}}, None, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, None, "send one of them"),
    ({"guided_json": {"type": "object"}}, None, 'structured_outputs={"json": ...}'),
    ({"guided_regex": "a+"}, None, 'structured_outputs={"regex": ...}'),
])
def test_bad_constraints_are_400(client, body, param, message):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"], err
    if param:
        assert err["param"] == param


def test_tool_choice_required_returns_tool_calls(client):
    # parallel_tool_calls=False caps the list at one call: the random model would list calls forever.
    r = client.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] in ("get_weather", "noop")
    if call["function"]["name"] == "get_weather":
        assert args["city"] in ("Paris", "Tokyo")


def test_required_output_with_several_calls_and_a_cut_one():
    from types import SimpleNamespace

    from kdaserve.server.tools import forced_tool_calls

    req = SimpleNamespace(tool_choice="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Tokyo"}}, {"name": "noop", "parameters": {}}]'
    calls = forced_tool_calls(req, text, "kimi")
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.noop:1"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Tokyo"}, {}]
    assert forced_tool_calls(req, text[:30], None) is None, "a cut output stays content"


def test_named_tool_choice(client):
    r = client.post("/v1/chat/completions", json=chat(tools=TOOLS,
                                                      tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Tokyo")
    assert choice["finish_reason"] == "stop", "OpenAI reports stop for a named function"


def test_streamed_forced_tool_calls(client):
    events = sse_events(client, "/v1/chat/completions", chat(tools=TOOLS, tool_choice="required", stream=True,
                                                             parallel_tool_calls=False))
    chunks = [e["choices"][0] for e in events if e != "[DONE]"]
    calls = [c for ch in chunks for c in ch["delta"].get("tool_calls", [])]
    assert calls and [c["index"] for c in calls] == list(range(len(calls)))
    assert all(json.loads(c["function"]["arguments"]) is not None for c in calls)
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert not "".join(ch["delta"].get("content") or "" for ch in chunks), "forced calls are not content"


def test_tool_choice_none_is_plain_chat(client):
    r = client.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice="none", max_tokens=5, logit_bias=None))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and isinstance(message["content"], str)


@pytest.mark.parametrize("body, message", [
    ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "--tool-call-parser"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "distinct function names"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "both constrain"),
    ({"tools": [{"type": "function", "function": {"name": "x", "description": "<|assistant|>"}}], "tool_choice": "required"},
     "control token"),
])
def test_bad_tool_requests_are_400(client, body, message):
    r = client.post("/v1/chat/completions", json=chat(**body))
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.json()


def test_tool_history_is_accepted(client):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.post("/v1/chat/completions", json=chat(messages=messages, tools=TOOLS, tool_choice="none", max_tokens=3))
    assert r.status_code == 200, r.text
