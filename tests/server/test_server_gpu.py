"""The server on a GPU: the `bench` model with auto backends and CUDA graphs, 64 concurrent streams
over real HTTP, every one complete with the right token count, with the engine in a thread and in
its own process; prints the throughput seen."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["process", "thread"])   # the process first: its device memory is freed when it ends
def test_bench_model_serves_64_concurrent_streams_on_gpu(mode):
    from kdaserve.engine.engine_process import EngineProcess
    from kdaserve.engine.llm_engine import LLMEngine
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    kwargs = dict(model="bench", max_num_seqs=64, max_model_len=2048, device="cuda")
    engine = EngineProcess(kwargs) if mode == "process" else LLMEngine(**kwargs)
    max_tokens = 64

    async def one(http, i):
        body = {"prompt": f"Request {i}: " + "lorem ipsum " * 20, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        streamed, usage, first = 0, None, None
        t0 = time.perf_counter()
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event["choices"]:   # one step's tokens, or several steps' when merged
                    streamed += len(event["choices"][0]["token_ids"])
                    first = first or time.perf_counter() - t0
                else:
                    usage = event["usage"]
        return streamed, usage["completion_tokens"], first

    with BackgroundServer(build_app(engine)) as srv:
        async def run_all():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
                await one(http, -1)  # warm-up (graph capture, autotuning)
                t0 = time.perf_counter()
                results = await asyncio.gather(*(one(http, i) for i in range(64)))
                return results, time.perf_counter() - t0

        results, seconds = asyncio.run(run_all())
    assert all(m == max_tokens and c == max_tokens for m, c, _ in results), results
    ttfts = sorted(r[2] for r in results)
    print(f"\n{mode}: 64 streams x {max_tokens} tokens: {64 * max_tokens / seconds:.0f} output tok/s over HTTP, "
          f"TTFT median {ttfts[32] * 1e3:.0f} ms, p99 {ttfts[-1] * 1e3:.0f} ms")
