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


def test_the_chunk_encoder_writes_what_the_standard_encoder_writes():
    """serving._json builds the C encoder once: the text must be JSONEncoder's, to the byte, for
    what chunks hold (non-ASCII and escapes, -inf log-probs, nesting, big and tiny numbers)."""
    import math

    from kdaserve.server.serving import _json

    standard = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    cases = [[{"index": 0, "text": 'h\u00e9\u2028\n"\\\ud83d\ude00', "logprobs": None, "finish_reason": None}],
             {"content": [{"token": "a", "logprob": -math.inf, "top_logprobs": [{"token": "b", "logprob": -1.5e-300}]}]},
             {"n": 2**70, "f": 0.1, "b": [True, False, None], "t": (1, 2), "e": {}}, [], "text", 3, None]
    for obj in cases:
        assert _json(obj) == standard(obj)
    with pytest.raises(TypeError, match="not JSON serializable"):
        _json([object()])
