"""Connection limits uvicorn lacks: a request's headers must arrive within `header_timeout`
seconds of the connection opening or of its previous response. A client that opens a connection
and sends nothing, or trickles its headers a byte at a time (slowloris), is closed then: uvicorn's
keep-alive timeout starts only after a first response and resets on every byte received.

Built as a subclass of the HTTP protocol uvicorn would pick (httptools when installed, else h11),
through their shared hooks: `connection_made`, `data_received`, `on_response_complete`,
`connection_lost` and the `cycle` of the request in progress."""

from __future__ import annotations

import asyncio
import logging
import socket

logger = logging.getLogger("kdaserve.server")
DEFAULT_HEADER_TIMEOUT = 10.0
# Each connection's kernel send buffer (SO_SNDBUF; Linux doubles it). A client that stops reading
# fills it before a write blocks and --stream-write-timeout starts counting: autotuned, it grows to
# several MB, minutes of tokens that keep the sequence generating.
DEFAULT_SEND_BUFFER_BYTES = 256 << 10


def http_protocol(name: str = "auto") -> type:
    """uvicorn's HTTP protocol class by uvicorn's name: "auto" (httptools when installed, else
    h11), "h11" or "httptools"."""
    if name == "auto":
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        return AutoHTTPProtocol
    if name == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    if name == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # ImportError without httptools

        return HttpToolsProtocol
    raise ValueError(f"invalid HTTP protocol {name!r}; expected auto, h11 or httptools")


def header_timeout_protocol(header_timeout: float, base: type | None = None,
                            send_buffer_bytes: int = DEFAULT_SEND_BUFFER_BYTES) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with the header deadline (pass it as uvicorn's `http`) and
    each connection's send buffer fixed at `send_buffer_bytes` (0: the kernel's autotuning)."""
    if not header_timeout > 0:
        raise ValueError(f"invalid header timeout: got {header_timeout}; expected seconds > 0")
    if send_buffer_bytes < 0:
        raise ValueError(f"invalid send buffer: got {send_buffer_bytes} bytes; expected >= 0 (0: the kernel's)")
    base = base or http_protocol()

    class HeaderDeadlineProtocol(base):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if send_buffer_bytes and sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
                except OSError:   # not a TCP socket (a Unix socket in a test): the kernel's default
                    pass
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._request_in_progress():   # its headers are in: the app has it now
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()                   # the next request's headers get the same time

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _request_in_progress(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self._request_in_progress() and not self.transport.is_closing():
                logger.debug("closing a connection that sent no complete request headers in %.1f s", header_timeout)
                self.transport.close()

    HeaderDeadlineProtocol.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadlineProtocol
