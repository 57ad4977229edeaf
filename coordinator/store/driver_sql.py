"""Hot-path statements run on the psycopg connection under a SQLAlchemy `Connection`.

The protocol's common path sends a handful of fixed statements per call, and SQLAlchemy's
execution and result layers cost more than psycopg itself for each of them: an execution context,
and a result whose metadata is rebuilt from the cursor's description (a psycopg `Column` per
column, ~20 of them for the joined rows) at every execution. psycopg's cursor costs about as much
again in Python (a cursor, its query conversion and prepared-statement bookkeeping: ~40 µs of a
~110 µs statement). `DriverStatement.rows` skips all of them: it runs its statement on the same
connection's libpq handle (`pgconn`, so inside the caller's transaction), as a statement it
prepares once per connection, with psycopg's own adapters dumping the parameters and loading the
rows, and answers tuples readable by column name (`Row`). What SQLAlchemy and psycopg would
otherwise do for us is kept:

- the transaction: a statement that finds the connection idle starts it with psycopg's BEGIN, as
  psycopg would before its first statement; SQLAlchemy's commit and rollback end it as always.
  The BEGIN (and a PREPARE the statement needs) travels with the statement in one libpq pipeline:
  one round trip, where psycopg takes one per command. A transaction's last statement may carry
  its COMMIT the same way (`rows(..., commit=True)`): SQLAlchemy's commit then finds the
  connection idle and psycopg sends nothing. Such a statement checks its own results in SQL
  (`coordinator_assert`, migration 0014), since a check in Python after it would come too late to
  roll it back; any statement after it in the same SQLAlchemy transaction is refused;
- the `before_cursor_execute` listeners still fire (the simulation's fault points, the statement
  counters of benchmarks and tests);
- a Postgres error is psycopg's exception for its SQLSTATE, and goes through SQLAlchemy's own error
  handling: raised as its `DBAPIError` of the same kind, with `connection_invalidated` set (and the
  pool's connections invalidated) when the connection died, so `CoordinatorBase._tx` retries
  exactly as before.
"""

from __future__ import annotations

import ctypes
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any, ClassVar

import psycopg
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer
from psycopg.errors import error_from_result
from sqlalchemy import Connection, Engine, event

from .. import on_loop

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


# --- one session's state: what it has prepared ---------------------------------------------------

_SESSION_KEY = "driver_sql"
_IDLE = pq.TransactionStatus.IDLE
_statement_numbers = itertools.count()  # its next() is atomic: threads share it


class _Session:
    """What the driver keeps for one DBAPI connection (in the pooled connection's `info`): the
    statements it prepared there, by SQL and parameter types, whether that record may be stale,
    and one transformer (adapters with their dumpers and loaders cached)."""

    __slots__ = ("raw", "prepared", "stale", "transformer", "committed_in")

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw
        self.prepared: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self.stale = False
        self.transformer = Transformer(raw)
        self.committed_in: Any = None  # the SQLAlchemy transaction a statement last committed with


def _session(conn: Connection) -> _Session:
    fairy = conn.connection
    raw = fairy.driver_connection
    assert isinstance(raw, psycopg.Connection), "the coordinator runs on psycopg 3"
    session = fairy.info.get(_SESSION_KEY)
    if session is None or session.raw is not raw:  # a connection replaced after an invalidation
        session = fairy.info[_SESSION_KEY] = _Session(raw)
    return session


# Postgres keeps a session's prepared statements until the session ends or a DEALLOCATE, and
# psycopg sends DEALLOCATE ALL after rolling back an open transaction once it has prepared
# statements of its own (it prepares any statement it sees five times: SQLAlchemy's too). So a
# rollback marks the session's record stale, and its next driver statement reads which of them
# are still there (one round trip, after a rollback only). `hook_engine` hooks an engine's
# rollbacks and pool resets; on an engine without it, or after a DEALLOCATE nobody announced, a
# statement fails with InvalidSqlStatementName, the session forgets what it had prepared, and the
# service retries the transaction (`CoordinatorBase._tx`), which prepares them again.
# It also refuses SQLAlchemy's own statements after a driver statement committed their
# transaction (driver statements check that themselves, on any engine).
def hook_engine(engine: Engine) -> None:
    def before_rollback(conn: Connection) -> None:
        if not conn.invalidated:
            _mark_stale(conn.connection.info, conn.connection.driver_connection)

    def before_reset(dbapi_connection: Any, connection_record: Any, reset_state: Any) -> None:
        if connection_record is not None:
            _mark_stale(connection_record.info, dbapi_connection)

    def before_execute(conn: Connection, cursor: Any, *args: Any) -> None:
        if cursor is not None:  # a driver statement (no cursor) has checked already
            _refuse_after_commit(conn)
            on_loop.refuse_blocking("a SQLAlchemy statement")  # psycopg would wait for it blocking

    event.listen(engine, "rollback", before_rollback)
    event.listen(engine.pool, "reset", before_reset)
    event.listen(engine, "before_cursor_execute", before_execute)


def transaction_started(conn: Connection) -> bool:
    """Whether conn's transaction has begun on the server (SQLAlchemy begins before psycopg does)."""
    return conn.connection.driver_connection.pgconn.transaction_status != _IDLE


def _refuse_after_commit(conn: Connection) -> None:
    session = conn.connection.info.get(_SESSION_KEY)
    if session is not None and session.committed_in is not None and session.committed_in is conn.get_transaction():
        raise AssertionError("a statement after the one its transaction committed with")


def _mark_stale(info: dict[str, Any], raw: Any) -> None:
    session = info.get(_SESSION_KEY)
    if session is not None and raw is session.raw and raw.pgconn.transaction_status != _IDLE:
        session.stale = True  # a rollback is about to be sent; an idle connection gets none


_PREPARED_HERE = b"SELECT name FROM pg_prepared_statements WHERE name LIKE 'driver\\_sql\\_%'"
_ANSWERED = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)
INVALID_STATEMENT_NAME = "26000"


def _checked(raw: psycopg.Connection[Any], result: pq.abc.PGresult) -> pq.abc.PGresult:
    if result.status not in _ANSWERED:
        raise error_from_result(result, encoding=raw.info.encoding)
    return result


def _begin_command(raw: psycopg.Connection[Any]) -> bytes:
    """The BEGIN psycopg sends before a transaction's first statement (its isolation options)."""
    parts = [b"BEGIN"]
    if raw.isolation_level is not None:
        parts += [b"ISOLATION LEVEL", raw.isolation_level.name.replace("_", " ").encode()]
    if raw.read_only is not None:
        parts.append(b"READ ONLY" if raw.read_only else b"READ WRITE")
    if raw.deferrable is not None:
        parts.append(b"DEFERRABLE" if raw.deferrable else b"NOT DEFERRABLE")
    return b" ".join(parts)


_SEND_QUERY, _SEND_PREPARE, _SEND_EXECUTE = b"query", b"prepare", b"execute"

# around a statement that runs its generic plan (DriverStatement's generic_plan); prepared like it.
# After it, the setting is the session's configured one (server, database, role or connection
# options): the coordinator never SETs it for a session.
_GENERIC_PLAN = b"SET LOCAL plan_cache_mode = force_generic_plan"
_PLAN_AS_CONFIGURED = b"SET LOCAL plan_cache_mode TO DEFAULT"


def _flush(pgconn: pq.abc.PGconn) -> None:
    """Send everything queued. psycopg keeps its connections non-blocking, so a pipeline's sends
    may leave part of a large one (a 200-partition commit) in libpq's buffer; the wait for the
    socket releases the GIL (or, on the event loop, lets other calls run), and reads what Postgres
    answers meanwhile, as libpq asks."""
    while pgconn.flush():
        on_loop.wait_socket(pgconn.socket, write=True)
        pgconn.consume_input()


def _wait_for_result(pgconn: pq.abc.PGconn) -> None:
    """Wait for the next result with the GIL released (psycopg's get_result keeps it while libpq
    blocks, which stopped every other thread for a round trip), or, in a call running on the event
    loop, with the loop free to run other calls (`on_loop.wait_socket`)."""
    pgconn.consume_input()
    while pgconn.is_busy():
        on_loop.wait_socket(pgconn.socket)
        pgconn.consume_input()


def _libpq_pipeline_sync() -> Any:
    """libpq's PQpipelineSync called through ctypes, which releases the GIL for the call: psycopg's
    pipeline_sync keeps it, and the call sends the pipeline (a socket write that wakes Postgres),
    so every other thread of the process waited on it (12% of an HTTP worker's GIL time at P=2).
    None where the libpq psycopg uses is not found as the one libpq mapped in this process."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().rsplit("/", 1)[-1].startswith("libpq")}
        if len(paths) != 1:
            return None
        sync = ctypes.CDLL(paths.pop()).PQpipelineSync
    except (OSError, AttributeError):
        return None
    sync.argtypes, sync.restype = [ctypes.c_void_p], ctypes.c_int
    return sync


_PIPELINE_SYNC: Any = None  # found at the first pipeline (psycopg's libpq is loaded by then)


def _pipeline_sync(pgconn: pq.abc.PGconn) -> None:
    global _PIPELINE_SYNC
    if _PIPELINE_SYNC is None:
        _PIPELINE_SYNC = _libpq_pipeline_sync() or False
    if _PIPELINE_SYNC is False:
        pgconn.pipeline_sync()
    elif _PIPELINE_SYNC(pgconn.pgconn_ptr) != 1:
        raise psycopg.OperationalError(f"sending the pipeline failed: {pgconn.error_message.decode(errors='replace')}")


def _pipelined(pgconn: pq.abc.PGconn, commands: list[tuple[bytes, Any]]) -> list[pq.abc.PGresult]:
    """Send the commands in one libpq pipeline and one flush; each command's result, in order. A
    command after a failed one is not run (its result is PIPELINE_ABORTED). The pipeline's sync
    ends no transaction a BEGIN opened; a failed command leaves it failed, for the rollback."""
    pgconn.enter_pipeline_mode()
    try:
        for kind, args in commands:
            if kind is _SEND_QUERY:
                pgconn.send_query_params(args, None)
            elif kind is _SEND_PREPARE:
                pgconn.send_prepare(*args)
            else:
                name, values, formats = args
                pgconn.send_query_prepared(name, values, formats)
        _pipeline_sync(pgconn)
        _flush(pgconn)
        results: list[pq.abc.PGresult] = []
        while True:
            _wait_for_result(pgconn)
            result = pgconn.get_result()
            if pgconn.status == pq.ConnStatus.BAD:  # nothing more will come
                message = pgconn.error_message.decode(errors="replace").strip()
                raise psycopg.OperationalError(f"the connection to Postgres was lost: {message}")
            if result is None:  # the end of one command's results
                continue
            if result.status == pq.ExecStatus.PIPELINE_SYNC:
                return results
            results.append(result)
    finally:
        if pgconn.status == pq.ConnStatus.OK and pgconn.pipeline_status != pq.PipelineStatus.OFF:
            try:
                pgconn.exit_pipeline_mode()
            except psycopg.Error:  # interrupted with results unread: this session cannot go on
                pgconn.finish()


class DriverStatement:
    """One fixed statement, written with SQLAlchemy's `:name` parameters (as in `text()`).

    `generic_plan`: the statement always runs its generic plan, planned once per session. Postgres
    plans a prepared statement anew at every execution (a custom plan, for the values given) when
    it estimates the generic plan costlier than the custom ones, which it does for statements over
    arrays of unknown length and for the pool's query (its `LIMIT`), and that planning was ~15% of
    Postgres' CPU on the hot path. Such a statement's execution is sent between a
    `SET LOCAL plan_cache_mode = force_generic_plan` and a `SET LOCAL ... TO DEFAULT` (the latter
    left out when the COMMIT follows it), in the same round trip; its generic plan is the one
    tests/test_driver_sql.py looks at."""

    __slots__ = ("sql", "generic_plan", "_query", "_params", "_formats", "_row_types")

    def __init__(self, sql: str, *, generic_plan: bool = False) -> None:
        self.generic_plan = generic_plan
        if "%" in sql:
            raise ValueError("a driver statement must not contain '%' (psycopg's placeholder character)")
        # as psycopg would show it (the listeners and error messages get this form) ...
        self.sql = _BIND.sub(r"%(\1)s", sql)
        # ... and as Postgres takes it: $n for the n-th distinct parameter
        params: list[str] = []

        def placeholder(m: re.Match[str]) -> str:
            if m.group(1) not in params:
                params.append(m.group(1))
            return f"${params.index(m.group(1)) + 1}"

        self._query = _BIND.sub(placeholder, sql).encode()
        self._params = tuple(params)
        self._formats = [PyFormat.AUTO] * len(params)
        # its rows' type by column count: a fixed statement's columns are fixed, and naming them
        # from the result at every execution cost ~1 µs a column (a joined row has ~45)
        self._row_types: dict[int, type[Row]] = {}

    def rows(self, conn: Connection, params: Mapping[str, Any], *, commit: bool = False) -> list[Row]:
        """Execute in conn's transaction, prepared; every result row (readable by column name).
        With `commit`, the transaction commits with the statement (it must be the transaction's
        last; see the module's docstring).

        A prepared statement soon runs Postgres' generic plan, which assumes ~10 elements in an
        array parameter: a statement over P rows must reach them by index whatever P is
        (tests/test_driver_sql.py checks the plans of a batch's statements)."""
        (rows,) = run_together(conn, ((self, params),), commit=commit)
        return rows

    def _load(self, session: _Session, result: pq.abc.PGresult) -> list[Row]:
        if result.nfields == 0:
            return []
        row_type = self._row_types.get(result.nfields)
        if row_type is None:
            names = tuple((result.fname(i) or b"").decode() for i in range(result.nfields))
            row_type = self._row_types[result.nfields] = _row_type(names)
        session.transformer.set_pgresult(result)
        return session.transformer.load_rows(0, result.ntuples, row_type)

    def first(self, conn: Connection, params: Mapping[str, Any], *, commit: bool = False) -> Row | None:
        rows = self.rows(conn, params, commit=commit)
        return rows[0] if rows else None

    def one(self, conn: Connection, params: Mapping[str, Any], *, commit: bool = False) -> Row:
        rows = self.rows(conn, params, commit=commit)
        if len(rows) != 1:
            raise AssertionError(f"expected exactly one row, got {len(rows)}")
        return rows[0]


def run_together(
    conn: Connection, statements: Sequence[tuple[DriverStatement, Mapping[str, Any]]], *, commit: bool = False
) -> list[list[Row]]:
    """Execute the statements one after the other in conn's transaction, sent in one round trip;
    each one's rows. Each runs with a snapshot of its own, taken when it starts: a statement after
    one that waited for a lock sees what the lock's previous holder committed. A failed statement
    stops the rest (they do not run) and is raised as `rows` raises it. With `commit`, as `rows`."""
    session = _session(conn)
    _refuse_after_commit(conn)
    for statement, params in statements:
        conn.dispatch.before_cursor_execute(conn, None, statement.sql, params, None, False)
    if commit:
        if conn.in_nested_transaction():
            raise ValueError("a statement inside a savepoint cannot commit its transaction")
        session.committed_in = conn.get_transaction()
    try:
        results = _execute(session, statements, commit)
    except _StatementFailed as failed:
        exc, (statement, params) = failed.error, statements[failed.index]
        if exc.sqlstate == INVALID_STATEMENT_NAME:
            session.prepared.clear()
        # SQLAlchemy's own handler (what Connection.execute calls): wraps the error, and on a
        # dead connection invalidates it and the pool's older connections, as for any statement
        conn._handle_dbapi_exception(exc, statement.sql, dict(params), None, None)
        raise AssertionError("unreachable: _handle_dbapi_exception raises") from exc
    return [statement._load(session, result) for (statement, _), result in zip(statements, results)]


class _StatementFailed(Exception):
    def __init__(self, error: psycopg.Error, index: int) -> None:
        self.error, self.index = error, index


def _execute(
    session: _Session, statements: Sequence[tuple[DriverStatement, Mapping[str, Any]]], commit: bool
) -> list[pq.abc.PGresult]:
    """Each statement's result; a failure as _StatementFailed naming the statement (the first, for
    a failure outside any statement: the connection lost, or the COMMIT refused)."""
    raw, tx = session.raw, session.transformer
    pgconn = raw.pgconn
    try:
        if session.stale:
            (listed,) = _pipelined(pgconn, [(_SEND_QUERY, _PREPARED_HERE)])
            _checked(raw, listed)
            still = {listed.get_value(i, 0) for i in range(listed.ntuples)}
            session.prepared = {k: name for k, name in session.prepared.items() if name in still}
            session.stale = False
        begin = pgconn.transaction_status == _IDLE and not raw.autocommit
        commands: list[tuple[bytes, Any]] = []  # sent in one round trip
        # per command: the caller's statement it belongs to, what it prepares, whether it answers
        roles: list[tuple[int, Any, bytes | None, bool]] = []

        def execute(i: int, query: bytes, values: Any, answers: bool) -> None:
            key = (query, tuple(tx.types))
            name = session.prepared.get(key)
            if name is None:
                name = b"driver_sql_%d" % next(_statement_numbers)
                commands.append((_SEND_PREPARE, (name, query, key[1])))
                roles.append((i, key, name, False))
            commands.append((_SEND_EXECUTE, (name, values, list(tx.formats))))
            roles.append((i, None, None, answers))

        if begin:
            commands.append((_SEND_QUERY, _begin_command(raw)))
            roles.append((0, None, None, False))
        last = len(statements) - 1
        for i, (statement, params) in enumerate(statements):
            generic = statement.generic_plan and not raw.autocommit  # SET LOCAL needs a transaction
            if generic:
                execute(i, _GENERIC_PLAN, tx.dump_sequence((), ()), False)
            values = tx.dump_sequence([params[name] for name in statement._params], statement._formats)
            name = session.prepared.get((statement._query, tuple(tx.types)))
            if (name is not None and not begin and not commit and not generic and len(statements) == 1
                    and not on_loop.on_loop()):  # libpq's blocking call: fewest calls into libpq
                return [_checked(raw, pgconn.exec_prepared(name, values, tx.formats))]
            execute(i, statement._query, values, True)
            if generic and not (commit and i == last):
                execute(i, _PLAN_AS_CONFIGURED, tx.dump_sequence((), ()), False)
        if commit:
            commands.append((_SEND_QUERY, b"COMMIT"))
            roles.append((0, None, None, False))
        results = _pipelined(pgconn, commands)
    except psycopg.Error as exc:
        raise _StatementFailed(exc, 0) from exc
    for (_, key, name, _), r in zip(roles, results):
        if key is not None and r.status == pq.ExecStatus.COMMAND_OK:
            session.prepared[key] = name
    answers = []
    for (i, _, _, answers_caller), r in zip(roles, results):
        try:  # the first failure is the error: the commands after it did not run
            _checked(raw, r)
        except psycopg.Error as exc:
            raise _StatementFailed(exc, i) from exc
        if answers_caller:
            answers.append(r)
    return answers
