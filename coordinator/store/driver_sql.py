"""Hot-path statements run on the psycopg connection under a SQLAlchemy `Connection`.

The protocol's common path sends a handful of fixed statements per call, and SQLAlchemy's
execution and result layers cost more than psycopg itself for each of them: an execution context,
and a result whose metadata is rebuilt from the cursor's description (a psycopg `Column` per
column, ~20 of them for the joined rows) at every execution. `DriverStatement.rows` skips both: it
runs the statement on the same DBAPI connection (so inside the caller's transaction; psycopg
prepares it after its `prepare_threshold` executions, as it did under SQLAlchemy) and answers
psycopg's tuples, readable by column name (`Row`). What SQLAlchemy would otherwise do for us is
kept:

- the `before_cursor_execute` listeners still fire (the simulation's fault points, the statement
  counters of benchmarks and tests);
- a psycopg error goes through SQLAlchemy's own error handling: raised as its `DBAPIError` of the
  same kind, with `connection_invalidated` set (and the pool's connections invalidated) when the
  connection died, so `CoordinatorBase._tx` retries exactly as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any, ClassVar

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import Connection

_BIND = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class Row(tuple):  # type: ignore[type-arg]
    """A result row: the tuple psycopg fetched, which also answers `row["column"]`. Each result's
    rows share a subclass whose `columns` maps names to positions (records are built from rows by
    position: `_Record.from_mapping`), so a row costs no dict of its own."""

    __slots__ = ()
    columns: ClassVar[dict[str, int]] = {}

    def __getitem__(self, key: Any) -> Any:
        if type(key) is str:
            return tuple.__getitem__(self, self.columns[key])
        return tuple.__getitem__(self, key)

    def as_dict(self) -> dict[str, Any]:
        return {name: tuple.__getitem__(self, i) for name, i in self.columns.items()}


@lru_cache(maxsize=512)
def _row_type(names: tuple[str, ...]) -> type[Row]:
    """One Row subclass per column list (the hot path has a few fixed ones)."""
    return type("Row", (Row,), {"__slots__": (), "columns": {name: i for i, name in enumerate(names)}})


def int_array(values: Iterable[int]) -> str:
    """A Postgres array literal of integers, bound as text to `CAST(:x AS bigint[])`. psycopg's
    list dumper works element by element in Python: ~0.17 ms per 200-element array, against
    ~0.03 ms to build this literal."""
    return "{" + ",".join(map(int.__repr__, values)) + "}"  # a TypeError for anything but an int


def text_array(values: Iterable[str]) -> str:
    """A Postgres array literal of strings (each double-quoted, backslash and quote escaped), bound
    as text to `CAST(:x AS text[])`, for the reason int_array gives."""
    return "{" + ",".join(['"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values]) + "}"


class DriverStatement:
    """One fixed statement, written with SQLAlchemy's `:name` parameters (as in `text()`)."""

    __slots__ = ("sql",)

    def __init__(self, sql: str) -> None:
        if "%" in sql:
            raise ValueError("a driver statement must not contain '%' (psycopg's placeholder character)")
        self.sql = _BIND.sub(r"%(\1)s", sql)

    def rows(self, conn: Connection, params: Mapping[str, Any], *, planned_for_values: bool = False) -> list[Row]:
        """Execute in conn's transaction; every result row (readable by column name).

        `planned_for_values`: not prepared, so Postgres plans this execution for its parameters'
        values. A prepared statement soon runs a generic plan, which assumes ~10 elements in an array
        parameter: with hundreds (a 200-partition batch) that plan can take a nested loop over a
        sequential scan, once per element."""
        raw = conn.connection.driver_connection
        assert isinstance(raw, psycopg.Connection), "the coordinator runs on psycopg 3"
        with raw.cursor(row_factory=tuple_row) as cur:
            conn.dispatch.before_cursor_execute(conn, cur, self.sql, params, None, False)
            try:
                # prepared by psycopg once it is seen repeating, unless planned for these values
                cur.execute(self.sql, params, prepare=False if planned_for_values else None)
            except psycopg.Error as exc:
                # SQLAlchemy's own handler (what Connection.execute calls): wraps the error, and on a
                # dead connection invalidates it and the pool's older connections, as for any statement
                conn._handle_dbapi_exception(exc, self.sql, dict(params), cur, None)
                raise AssertionError("unreachable: _handle_dbapi_exception raises") from exc
            result = cur.pgresult
            if result is None or result.nfields == 0:
                return []
            row_type = _row_type(tuple(result.fname(i).decode() for i in range(result.nfields)))  # type: ignore[union-attr]
            return list(map(row_type, cur.fetchall()))

    def first(self, conn: Connection, params: Mapping[str, Any]) -> Row | None:
        rows = self.rows(conn, params)
        return rows[0] if rows else None

    def one(self, conn: Connection, params: Mapping[str, Any]) -> Row:
        rows = self.rows(conn, params)
        if len(rows) != 1:
            raise AssertionError(f"expected exactly one row, got {len(rows)}")
        return rows[0]

