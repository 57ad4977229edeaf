"""The transport `coordinator serve` gives uvicorn's protocol (coordinator/http/server_protocol.py):
a turn's writes leave as one write at the turn's end, in order; nothing is held past a close.
On a real event loop, with a transport that records what reaches it. (That `coordinator serve`
answers through it is shown by every test that drives the real server: test_serve_keepalive,
the CLI tests.)"""

from __future__ import annotations

import asyncio

import uvloop

from coordinator.http.server_protocol import OneWritePerTurnTransport


class Recording(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        assert not self.closed, "a write after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 5)}.get(name, default)


def run(scenario: object) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario)  # type: ignore[arg-type]


def test_a_turns_writes_leave_together_at_its_end_in_order() -> None:
    async def scenario() -> None:
        inner = Recording()
        t = OneWritePerTurnTransport(inner, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b'{"a": 1}')
        assert inner.writes == []  # held until the turn ends
        await asyncio.sleep(0)
        assert inner.writes == [b'HTTP/1.1 200 OK\r\n\r\n{"a": 1}']
        t.write(b"next")  # another turn: a write of its own
        await asyncio.sleep(0)
        t.write(bytearray(b"and"))
        t.write(memoryview(b" more"))
        await asyncio.sleep(0)
        assert inner.writes[1:] == [b"next", b"and more"]
        assert t.get_extra_info("peername") == ("127.0.0.1", 5)  # the rest is the transport's

    run(scenario())


def test_a_close_sends_what_is_held_first_and_later_writes_are_dropped() -> None:
    async def scenario() -> None:
        inner = Recording()
        t = OneWritePerTurnTransport(inner, asyncio.get_running_loop())
        t.write(b"head")
        t.write(b"body")
        t.close()
        assert inner.writes == [b"headbody"] and inner.closed and t.is_closing()
        t.write(b"late")  # as a closed transport drops it: no error, nothing sent
        await asyncio.sleep(0)
        assert inner.writes == [b"headbody"]

    run(scenario())
