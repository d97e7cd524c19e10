"""Clients that stop reading: a stream's write that cannot complete within the write timeout aborts
the request and frees its slots; outputs piling up for a handler that does not take them are
capped, then the request is aborted."""

from __future__ import annotations

import asyncio

from kdaserve.server.engine_loop import RequestGroup
from kdaserve.server.serving import EventStreamResponse


def test_a_stream_whose_client_reads_nothing_is_aborted_within_the_write_timeout():
    closed = []

    async def body():
        for i in range(1000):
            yield f"data: {i}\n\n"

    async def receive():
        await asyncio.sleep(3600)        # the client never sends a disconnect either

    sent = []

    async def send(message):
        sent.append(message)
        if len(sent) > 3:                # the socket's buffers are full from the 4th write on
            await asyncio.sleep(3600)

    async def run():
        response = EventStreamResponse(body(), on_close=lambda: closed.append(True), write_timeout=0.2)
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(response(scope, receive, send), 5)
        return response, asyncio.get_running_loop().time() - t0

    response, seconds = asyncio.run(run())
    assert response.timed_out and closed and seconds < 2
    assert sent[0]["type"] == "http.response.start" and len(sent) == 4
    assert all(m.get("more_body", True) for m in sent[1:]), "the response is left unfinished: the connection closes"


class _FakeLoop:
    def __init__(self):
        self.posted, self.released = [], 0

    def _post(self, command):
        self.posted.append(command)

    def _release(self, n):
        self.released += n


def test_outputs_a_handler_does_not_take_are_capped_then_the_request_is_aborted():
    class Out:
        finished = False

        def __init__(self, token):
            self.new_token_ids = [token]

    async def run():
        engine_loop = _FakeLoop()
        group = RequestGroup(engine_loop, ["a", "b"], asyncio.get_running_loop(), max_pending=5)
        for token in range(5):
            group._put(0, Out(token))                      # merged: one output for member 0
        assert not group.overflowed and not engine_loop.posted
        group._put(1, Out(9))                              # the 6th: over the cap
        group._put(1, Out(9))                              # dropped: the request is gone
        assert group.overflowed and engine_loop.released == 2
        assert sorted(c[1] for c in engine_loop.posted) == ["a", "b"]   # both members aborted
        taken = await group.next()
        try:
            await group.next()
        except Exception as exc:                           # noqa: BLE001
            return taken, exc
        return taken, None

    taken, error = asyncio.run(run())
    assert taken[0] == 0 and taken[1].new_token_ids == [0, 1, 2, 3, 4]
    assert error is not None and error.status == 503 and "did not read its stream" in error.message


def test_outputs_a_handler_has_not_taken_yet_merge_per_member():
    """A handler behind its engine gets one output per member with every new token since the
    last it took (fewer, larger SSE chunks), in order, and errors after the outputs before them."""
    from kdaserve.engine.outputs import RequestOutput
    from kdaserve.server.errors import APIError

    def out(ids, new, finished=False):
        return RequestOutput("r", [1], ids, new, "", finished, "length" if finished else None)

    async def run():
        group = RequestGroup(_FakeLoop(), ["a", "b"], asyncio.get_running_loop())
        group._put(0, out([5], [5]))
        group._put(1, out([7], [7]))
        group._put(0, out([5, 6], [6]))
        group._put(0, out([5, 6, 8], [8], finished=True))
        first = [await group.next(), await group.next()]
        group._put(1, out([7, 9], [9]))
        group._put(1, APIError(500, "engine step failed"))
        second = await group.next()
        try:
            await group.next()
        except APIError as exc:
            return first, second, exc

    first, second, error = asyncio.run(run())
    assert [(i, o.new_token_ids, o.output_token_ids, o.finished) for i, o in first] == [
        (0, [5, 6, 8], [5, 6, 8], True), (1, [7], [7], False)]
    assert (second[0], second[1].new_token_ids) == (1, [9]) and error.status == 500


def test_a_group_yields_progress_only_and_replays_what_was_taken_first():
    """Outputs with no new token that do not end the member (a prompt chunk's log-probs) never
    reach the handler; outputs taken to wait for every member's first token (run_group) come
    back first, in order, and the group still ends after the last member finished."""
    from kdaserve.engine.outputs import RequestOutput

    def out(ids, new, finished=False):
        return RequestOutput("r", [1], ids, new, "", finished, "length" if finished else None)

    async def run():
        group = RequestGroup(_FakeLoop(), ["a", "b"], asyncio.get_running_loop())
        group._put(0, out([], []))                          # no progress: dropped
        group._put(1, out([7], [7], finished=True))
        taken = [await group.next()]
        group._put(0, out([5], [5]))
        taken.append(await group.next())
        group._put(0, out([5, 6], [6], finished=True))
        group.replay(taken)
        streamed = [(i, o.new_token_ids) async for i, o in group]
        done = RequestGroup(_FakeLoop(), ["c"], asyncio.get_running_loop())   # ended before the replay
        done._put(0, out([3], [3], finished=True))
        done.replay([await done.next()])
        return streamed, [(i, o.new_token_ids) async for i, o in done]

    assert asyncio.run(run()) == ([(1, [7]), (0, [5]), (0, [6])], [(0, [3])])


def _tokens_before_abort(send_buffer_bytes: int, max_tokens: int = 4000) -> int:
    """A real connection whose client never reads (and keeps a small receive buffer): the tokens
    its request generated before the server aborted it (or all of them, had it finished)."""
    import socket
    import time

    from server_helpers import ENGINE_KWARGS

    from kdaserve.engine.llm_engine import LLMEngine
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer

    engine = LLMEngine(**{**ENGINE_KWARGS, "max_model_len": max_tokens + 64})
    app = build_app(engine, stream_write_timeout=1.0)
    with BackgroundServer(app, send_buffer_bytes=send_buffer_bytes) as srv:
        body = ('{"model": "tiny", "prompt": "Hi", "max_tokens": %d, "ignore_eos": true, "stream": true}' % max_tokens)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", srv.port))
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 300
        while engine.stats()["generation_tokens"] == 0 or engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        client.close()
        return engine.stats()["generation_tokens"]


def test_a_client_that_stops_reading_can_leave_only_the_send_buffer_unread():
    """The write timeout starts only once a write blocks, after the kernel's buffers fill: autotuned,
    several MB of SSE chunks (minutes of tokens at serving speed); with the connection's send buffer
    fixed (--send-buffer-bytes, 256 KiB by default) the request is aborted after far fewer."""
    bounded = _tokens_before_abort(256 << 10)                # ~2500 tokens of SSE chunks here
    assert bounded < 3500, bounded                           # aborted, far from finished
    assert _tokens_before_abort(0) == 4000                   # the kernel's own buffers took all 4000
