"""A stream's chunks write their constant envelope's JSON once: every chunk must still be exactly
the JSON of the whole object (the same bytes as encoding it whole)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kdaserve.server.serving import response_envelope, sse, stream_chunks


@pytest.mark.parametrize("include_usage", [False, True])
def test_chunks_are_the_whole_objects_json(include_usage):
    chunk = stream_chunks(SimpleNamespace(include_usage=include_usage), "cmpl-1", "text_completion", 'm\u00e9"[]')
    cases = [([{"index": 0, "text": 'h\u00e9\n"[]', "logprobs": None, "finish_reason": None}], None, None),
             ([], {"prompt_tokens": 1, "completion_tokens": 2}, {"time_to_first_token": 0.1}),
             ([{"index": 1, "text": "", "finish_reason": "length"}], None, {})]
    for choices, usage, metrics in cases:
        got = chunk(choices, usage, metrics)
        body = response_envelope("cmpl-1", "text_completion", json.loads(got[len("data: "):])["created"], 'm\u00e9"[]', choices)
        if include_usage:
            body["usage"] = usage
        if metrics:
            body["metrics"] = metrics
        assert got == sse(body)
