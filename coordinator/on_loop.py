"""Running the service's blocking code on the event loop's thread, its waits awaited (issue 12).

The service is synchronous: its statements wait for Postgres, its Kafka calls for the broker. The
HTTP layer used to hand every begin and commit to a thread, and that hand-off (a thread woken, the
GIL passed to it and back, the answer handed back to the loop) cost about a fifth of the
coordinator's CPU per two-partition batch over HTTP. `run_on_loop` runs such a call in a greenlet
on the loop's own thread instead: the code stays synchronous, and where it would wait for a socket
it calls `wait_socket`, which, inside such a greenlet, switches back to the loop until the socket
is ready (other calls run meanwhile), and anywhere else waits as before. The driver statements
(`store/driver_sql.py`, the protocol's common path) wait there.

Nothing that runs on the loop may block the thread on what another call of the same loop holds: a
row lock of another call's open transaction, a pooled connection. So:

- a SQLAlchemy statement (psycopg waits for it blocking) is refused there: `refuse_blocking`
  raises `MustNotBlock`, the call's transaction rolls back, and the caller runs the call again in a
  thread, as a driver's retry after a lost answer does, which the protocol makes safe. The common
  path of begin and commit runs driver statements only;
- work that blocks on Kafka goes to a thread pool and is awaited: `wait_futures`;
- the caller bounds how many calls run on the loop at once below what the connection pool holds,
  so a checkout never waits for a connection that only a suspended greenlet could give back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import select
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from greenlet import getcurrent, greenlet

T = TypeVar("T")


class MustNotBlock(Exception):
    """Raised where a call running on the loop would wait blocking (see the module's docstring);
    its caller runs it again in a thread."""


class _OnLoop(greenlet):  # type: ignore[misc]
    """The greenlet of one call run on the loop; its parent is the loop's."""


def on_loop() -> bool:
    """Whether this code runs in a call of `run_on_loop` (and must not block)."""
    return type(getcurrent()) is _OnLoop


def refuse_blocking(what: str) -> None:
    if type(getcurrent()) is _OnLoop:
        raise MustNotBlock(f"{what} would block the event loop")


def wait_socket(fd: int, *, write: bool = False) -> None:
    """Until fd is readable (or, with `write`, readable or writable)."""
    if type(getcurrent()) is _OnLoop:
        getcurrent().parent.switch(lambda: _ready(fd, write))
        return
    poll = select.poll()
    poll.register(fd, select.POLLIN | select.POLLOUT if write else select.POLLIN)
    poll.poll()


def wait_futures(futures: Iterable[concurrent.futures.Future[Any]]) -> None:
    """Until every future is done (their results are the caller's to read)."""
    pending = list(futures)
    if pending and type(getcurrent()) is _OnLoop:
        getcurrent().parent.switch(lambda: asyncio.wait([asyncio.wrap_future(f) for f in pending]))
        return
    concurrent.futures.wait(pending)


async def _ready(fd: int, write: bool) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    if write:
        loop.add_writer(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
        if write:
            loop.remove_writer(fd)


async def run_on_loop(fn: Callable[[], T]) -> T:
    """fn() in a greenlet on this loop's thread, in a copy of the current context; its waits are
    awaited here. Cancelled meanwhile, the call still runs to its end, as it would in a thread
    (its transaction is not cut in the middle of a round trip), and the cancellation is raised
    then."""
    call = _OnLoop(fn)
    call.gr_context = contextvars.copy_context()
    wanted: Any = call.switch()
    cancelled: asyncio.CancelledError | None = None
    while not call.dead:
        wait: Callable[[], Awaitable[Any]] = wanted
        try:
            await wait()
        except asyncio.CancelledError as exc:
            cancelled = exc
            continue  # the same wait again
        except Exception as exc:  # noqa: BLE001 - raised inside the call, where it waited
            wanted = call.throw(exc)
            continue
        wanted = call.switch()
    if cancelled is not None:
        raise cancelled
    return wanted  # type: ignore[no-any-return]
