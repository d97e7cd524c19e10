"""The official `openai` Python client, unchanged, against the server."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_models_and_completions(oai):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    out = oai.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    scored = oai.completions.create(model="tiny", prompt="Hello", max_tokens=1, temperature=0, echo=True, logprobs=1)
    assert scored.choices[0].text.startswith("Hello")
    assert scored.choices[0].logprobs.token_logprobs[0] is None and len(scored.choices[0].logprobs.tokens) == 6


def test_chat_and_streaming(oai):
    messages = [{"role": "user", "content": "Hi"}]
    out = oai.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 3
    stream = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    completion_stream = oai.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert sum(len(c.choices[0].token_ids) for c in completion_stream if c.choices) == 3   # chunks may merge steps


def test_errors_raise_typed_exceptions(oai):
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="tiny", prompt="Hello", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="Hello")
    assert oai.completions.create(model="tiny", prompt="Hello", max_tokens=1).usage.completion_tokens == 1


def test_tool_calls_and_json_schema_through_the_client(oai):
    pytest.importorskip("xgrammar")
    import json

    no_space = {"9": -100, "10": -100, "13": -100, "32": -100}   # the random model's whitespace runs
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}, "required": ["city"]}}}]
    out = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                      temperature=0, max_tokens=60, logit_bias=no_space)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                      max_tokens=60, logit_bias=no_space,
                                      response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)
