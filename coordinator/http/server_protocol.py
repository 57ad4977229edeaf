"""uvicorn's httptools protocol, with the writes of one turn of the event loop sent as one.

uvicorn writes a response's head and its body to the socket separately: two `send` calls, two
TCP segments on a connection with TCP_NODELAY (which the server needs: without it the second
write waits for the client's delayed ACK, tests/test_serve_keepalive.py), and two wake-ups of
the client. A protocol call's answer is a head and a body written in the same turn of the loop
(nothing between them waits), so this transport holds each turn's writes and sends them together
at the turn's end, or when the connection is closed. The profile of the two-partition HTTP bench
put uvicorn's response writes at ~9% of the workers' GIL time.

`coordinator serve` runs uvicorn with `http=OneWritePerTurnProtocol`."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class OneWritePerTurnTransport:
    """A connection's transport whose writes made in one turn of the loop go out as one write at
    its end (in order); everything else is the transport's own."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def flush(self) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            if not self._transport.is_closing():  # as the transport drops writes after its close
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWritePerTurnProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # flow control keeps the transport itself
        self.transport = OneWritePerTurnTransport(transport, self.loop)  # type: ignore[assignment]
