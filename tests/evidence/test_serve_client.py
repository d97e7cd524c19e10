"""bench/serve_client.py's timing of one streamed request, on a scripted SSE stream: every chunk
with a choice is a token step even when its text is empty (a model whose tokens decode to no
character yet), as `vllm bench serve` counts them; a stream without a token is a failure that says so."""

from __future__ import annotations

import asyncio
import json

import httpx

from kdaserve.evidence.serve_client import _one


def _stream(chunks: list[dict]) -> httpx.AsyncClient:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body,
                                                                   headers={"content-type": "text/event-stream"}))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def _request(chunks):
    async with _stream(chunks) as client:
        return await _one(client, "m", [1, 2, 3], 4)


def test_chunks_with_empty_text_are_token_steps():
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("", "", "a", "")]
    chunks.append({"choices": [], "usage": {"completion_tokens": 4}})
    out = asyncio.run(_request(chunks))
    assert out["success"] and out["error"] == "" and out["output_len"] == 4
    assert out["ttft"] is not None and len(out["itls"]) == 3


def test_a_stream_without_a_token_fails_with_a_reason():
    out = asyncio.run(_request([{"choices": [], "usage": {"completion_tokens": 0}}]))
    assert not out["success"] and out["error"] == "the stream ended without a token"
