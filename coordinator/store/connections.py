"""Connections the service keeps out of the engine's pool between its transactions.

A transaction through `Engine.begin` checks a connection out of the pool, builds a `Connection`
around it, and checks it back in with the pool's reset: ~50 µs of client CPU of a one-statement
transaction's ~110 µs here, and a batch runs three (bench/README.md, twenty-second round). The
shelf keeps a few `Connection`s checked out instead: a transaction takes one (the most recently
used: LIFO), begins and ends its transaction on it, and puts it back if it is sound. Sound: not
invalidated, no transaction left open on the server, from the engine's current pool, out of the
pool for less than its recycle age (which the pool counts from the connection's opening: a shelved
connection is recycled at most that much later than a pooled one), and the shelf not full
(`keep`). Anything else goes back to the pool, which resets, recycles or drops it as it does any
connection. A dead connection empties the shelf: the others were opened as long ago and may have
died with it (a Postgres restart); the pool reconnects its own after the error (SQLAlchemy
invalidates the older ones).

What a connection on the shelf carries between transactions is only what the pool would keep
too: the session's prepared statements (store.driver_sql's record of them lives on the DBAPI
connection either way). Nothing in the service changes a session setting outside a transaction
(`SET LOCAL` and `set_config(..., true)` end with it); an isolation level set through
`execution_options` would outlive the transaction here, so the service sets none on these.

Idle connections on the shelf count against the pool's size. At most `keep` wait there, and a
connection is only shelved by a transaction that had it, so the shelf and the transactions running
hold no more connections than the most transactions that ran at once."""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, event
from sqlalchemy.pool import Pool, QueuePool

from .driver_sql import transaction_started

# the pool's recycle age (store.db.make_engine), which the shelf keeps to as well
RECYCLE_S = 1800

_SHELVES: weakref.WeakKeyDictionary[Engine, ConnectionShelf] = weakref.WeakKeyDictionary()
_SHELVES_LOCK = threading.Lock()


class ConnectionShelf:
    """See the module's docstring. The service's shelf is the engine's (`of`): every coordinator
    object on an engine shares it, so one dropped without `close` (a simulated crash) holds none
    of the pool's connections."""

    def __init__(self, engine: Engine, keep: int | None = None, max_age_s: float = RECYCLE_S) -> None:
        """`keep`: at most that many connections wait on the shelf; by default half the pool's
        size (none for a pool that keeps no connections, such as NullPool)."""
        if keep is None:
            keep = engine.pool.size() // 2 if isinstance(engine.pool, QueuePool) else 0
        if keep < 0:
            raise ValueError("keep must be >= 0")
        self._engine = weakref.ref(engine)  # the engine keeps its shelf (`of`, the event below), not the reverse
        self.keep, self.max_age_s = keep, max_age_s
        self._idle: deque[tuple[Connection, Pool, float]] = deque()  # (connection, its pool, checked out at)
        event.listen(engine, "engine_disposed", self._on_dispose)

    @classmethod
    def of(cls, engine: Engine) -> ConnectionShelf:
        """The engine's shelf, made at its first use."""
        with _SHELVES_LOCK:
            shelf = _SHELVES.get(engine)
            if shelf is None:
                shelf = _SHELVES[engine] = cls(engine)
            return shelf

    @property
    def engine(self) -> Engine:
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the shelf's engine is gone")
        return engine

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction, committed when the block ends, rolled back if it raises
        (as `Engine.begin`)."""
        conn, pool, since = self._take()
        try:
            with conn.begin():
                yield conn
        except BaseException:
            if conn.invalidated:  # its session died: so may have the shelved ones
                self.clear()
            raise
        finally:
            if self._sound(conn, pool, since):
                self._idle.append((conn, pool, since))
            else:
                conn.close()

    def idle(self) -> int:
        """How many connections wait on the shelf."""
        return len(self._idle)

    def clear(self) -> None:
        """Every shelved connection back to the pool (closed for good if its pool was disposed)."""
        while True:
            try:
                conn, pool, _ = self._idle.pop()
            except IndexError:
                return
            self._release(conn, pool)

    def _take(self) -> tuple[Connection, Pool, float]:
        while True:
            try:
                conn, pool, since = self._idle.pop()
            except IndexError:
                pool = self.engine.pool
                return self.engine.connect(), pool, time.monotonic()
            if pool is self.engine.pool and time.monotonic() - since < self.max_age_s:
                return conn, pool, since
            self._release(conn, pool)

    def _sound(self, conn: Connection, pool: Pool, since: float) -> bool:
        return (
            not conn.closed and not conn.invalidated and not transaction_started(conn)
            and pool is self.engine.pool and time.monotonic() - since < self.max_age_s
            and len(self._idle) < self.keep
        )

    def _release(self, conn: Connection, pool: Pool) -> None:
        if pool is not self.engine.pool:  # a disposed pool would keep it open: close it
            conn.invalidate()
        conn.close()

    def _on_dispose(self, engine: Engine) -> None:
        self.clear()
