"""The stack's floor: what a batch's calls cost on the coordinator's stack with nothing but the
durable writes a batch needs, so a run can say how far the coordinator is from what the stack
itself allows on this host: the least any implementation of these writes costs on this stack.

The floor server is a bare ASGI app under uvicorn, run as `coordinator serve` runs it (uvloop,
httptools, `--workers`), speaking the coordinator's wire API for the calls the benchmark's load
makes (generation start, begin with a partition count, a lease per task try, commit with the
winners' records), so the very same load drives both. Its Postgres work is the leanest layout
that still keeps the protocol's durable facts:

- begin: the sink's row locked (begins of one sink take turns: the held ids are read after the
  lock), the batch refused if another batch of the sink is unfinished, the batch inserted holding
  the first P ids of the sink's pool on its own row (no row per id), committed durably; one round
  trip;
- lease: the try's claim of its partition's pre-lease inserted durably (one row; a second try of
  the partition is refused: the floor has no pool to give it a fresh id from), answering the id;
  one round trip. A claim must be durable before the try's producer exists, so no implementation
  makes it cheaper than one durable write;
- commit: the decision (generation, attempt, OPEN, the deadline outside the margin) and the
  records in one durable statement, then the committed mark asynchronously (as the coordinator's).

What it leaves out is what the coordinator is for beyond those writes: a token per sink checked
by a dict lookup only, no body validation beyond JSON, no rules (a record's try is not compared
with its claim), no attempts or lease rows, no events, no offsets digest, no recovery loop,
metrics or Kafka pass. So it is a bound no implementation on this stack and these writes gets
under, not a design to ship: it answers only its one happy path and refuses (409) anything else.

protocol_bench.py runs it beside `coordinator serve` in its default run, or alone:

    python bench/protocol_bench.py --mode stack-floor --shape 2:12
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pydantic_core
from psycopg import pq

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SCHEMA = "stack_floor"
MARGIN_MS = 10_000
TIMEOUT_MS = 60_000
FIRST_TRY_ID_BASE = 1 << 50  # lease ids in the coordinator's range for first tries

DDL = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE IF NOT EXISTS {SCHEMA}.sinks (
    id bigserial PRIMARY KEY, name text NOT NULL UNIQUE, token text NOT NULL, generation int NOT NULL,
    timeout_ms int NOT NULL, pool text[] NOT NULL
) WITH (fillfactor = 80);
CREATE TABLE IF NOT EXISTS {SCHEMA}.batches (
    sink_id bigint NOT NULL REFERENCES {SCHEMA}.sinks, batch_id bigint NOT NULL, state text NOT NULL,
    attempt int NOT NULL, generation int NOT NULL, tids text[] NOT NULL, started_at timestamptz NOT NULL,
    deadline_at timestamptz NOT NULL, decided_at timestamptz, committed_at timestamptz, records text,
    PRIMARY KEY (sink_id, batch_id)
) WITH (fillfactor = 80);
CREATE INDEX IF NOT EXISTS batches_unfinished ON {SCHEMA}.batches (sink_id) WHERE committed_at IS NULL;
CREATE TABLE IF NOT EXISTS {SCHEMA}.claims (
    sink_id bigint NOT NULL, batch_id bigint NOT NULL, partition int NOT NULL, task_attempt_id bigint NOT NULL,
    PRIMARY KEY (sink_id, batch_id, partition), FOREIGN KEY (sink_id, batch_id) REFERENCES {SCHEMA}.batches
);
"""

# (name, SQL with $n parameters)
_LOCK_SINK = ("floor_lock", f"SELECT id FROM {SCHEMA}.sinks WHERE name = $1 AND generation = $2 FOR NO KEY UPDATE")
_BEGIN = ("floor_begin", f"""
INSERT INTO {SCHEMA}.batches (sink_id, batch_id, state, attempt, generation, tids, started_at, deadline_at)
SELECT s.id, $2, 'OPEN', 1, s.generation, s.pool[1:$3], clock_timestamp(),
       clock_timestamp() + s.timeout_ms * interval '1 millisecond'
FROM {SCHEMA}.sinks AS s
WHERE s.name = $1 AND s.generation = $4 AND cardinality(s.pool) >= $3
AND NOT EXISTS (SELECT 1 FROM {SCHEMA}.batches AS o WHERE o.sink_id = s.id AND o.committed_at IS NULL)
ON CONFLICT DO NOTHING
RETURNING array_to_json(tids), deadline_at
""")
_CLAIM = ("floor_claim", f"""
INSERT INTO {SCHEMA}.claims (sink_id, batch_id, partition, task_attempt_id)
SELECT b.sink_id, b.batch_id, $3, $4
FROM {SCHEMA}.sinks AS s JOIN {SCHEMA}.batches AS b ON b.sink_id = s.id
WHERE s.name = $1 AND b.batch_id = $2 AND s.generation = $5 AND b.state = 'OPEN' AND $3 < cardinality(b.tids)
ON CONFLICT DO NOTHING
RETURNING (SELECT b.tids[$3::int + 1] FROM {SCHEMA}.batches AS b WHERE b.sink_id = claims.sink_id
           AND b.batch_id = claims.batch_id)
""")
_DECIDE = ("floor_decide", f"""
UPDATE {SCHEMA}.batches AS b SET state = 'COMMITTING', records = $5, decided_at = clock_timestamp()
FROM {SCHEMA}.sinks AS s
WHERE s.name = $1 AND b.sink_id = s.id AND b.batch_id = $2 AND b.attempt = $3 AND s.generation = $4
AND b.state = 'OPEN' AND b.deadline_at > clock_timestamp() + {MARGIN_MS} * interval '1 millisecond'
RETURNING b.sink_id
""")
_MARK = ("floor_mark", f"""
UPDATE {SCHEMA}.batches SET state = 'COMMITTED', committed_at = clock_timestamp()
WHERE sink_id = $1 AND batch_id = $2 AND state = 'COMMITTING'
""")
_ASYNC_COMMIT = b"SET LOCAL synchronous_commit = off"


class FloorRefused(Exception):
    pass


class _Connection:
    """One libpq connection, its statements prepared once, each call's commands sent in one
    pipeline and awaited on the event loop."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.Connection.connect(url, autocommit=True)
        self.pg = self.conn.pgconn
        for name, sql in (_LOCK_SINK, _BEGIN, _CLAIM, _DECIDE, _MARK):
            result = self.pg.prepare(name.encode(), sql.encode())
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise RuntimeError(result.error_message.decode())
        self.pg.nonblocking = 1

    async def _wait(self, writable: bool) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.pg.socket
        (loop.add_writer if writable else loop.add_reader)(fd, ready.set_result, None)
        try:
            await ready
        finally:
            (loop.remove_writer if writable else loop.remove_reader)(fd)

    async def run(self, commands: list[tuple[str | bytes, list[bytes] | None]]) -> list[list[bytes] | None]:
        """Each command a prepared statement's name with its parameters, or SQL text (None);
        the first row of each statement that returns rows, None where it returned none."""
        pg = self.pg
        pg.enter_pipeline_mode()
        try:
            for command, params in commands:
                if isinstance(command, bytes):
                    pg.send_query_params(command, None)
                else:
                    pg.send_query_prepared(command.encode(), params)
            pg.pipeline_sync()
            while pg.flush():
                await self._wait(True)
            rows: list[list[bytes] | None] = []
            error = None
            while True:
                while pg.is_busy():
                    await self._wait(False)
                    pg.consume_input()
                result = pg.get_result()
                if result is None:
                    continue
                if result.status == pq.ExecStatus.PIPELINE_SYNC:
                    break
                if result.status == pq.ExecStatus.FATAL_ERROR:
                    error = error or result.error_message.decode()
                elif result.status == pq.ExecStatus.TUPLES_OK:
                    rows.append([result.get_value(0, j) for j in range(result.nfields)] if result.ntuples else None)
            if error:
                raise RuntimeError(error)
            return rows
        finally:
            pg.exit_pipeline_mode()
            if pg.transaction_status != pq.TransactionStatus.IDLE:  # a failed statement left BEGIN's block open
                self.conn.rollback()


class FloorApp:
    """The ASGI app (one per worker process; its connections are made on first use)."""

    _BEGIN_PATH = re.compile(r"^/v1/sinks/([^/]+)/checkpoints/(\d+)/begin$")
    _LEASE_PATH = re.compile(r"^/v1/sinks/([^/]+)/checkpoints/(\d+)/attempts/(\d+)/leases$")
    _COMMIT_PATH = re.compile(r"^/v1/sinks/([^/]+)/checkpoints/(\d+)/attempts/(\d+)/commit$")
    _GENERATIONS_PATH = re.compile(r"^/v1/sinks/([^/]+)/generations$")
    # what the load reads of the coordinator's schema: begin answers a pre-lease count (every try
    # asks for its lease)
    _OPENAPI = pydantic_core.to_json({"components": {"schemas": {"BeginOut": {
        "properties": {"action": {}, "attempt": {}, "pre_leased": {}}}}}})

    def __init__(self, url: str, connections: int) -> None:
        self.url = url
        self.size = connections
        self.pool: asyncio.Queue[_Connection] | None = None
        self.tokens: dict[str, str] = {}

    async def _connection(self) -> _Connection:
        if self.pool is None:
            pool: asyncio.Queue[_Connection] = asyncio.Queue()
            for _ in range(self.size):
                pool.put_nowait(_Connection(self.url))
            self.pool = pool
        return await self.pool.get()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            status, answer = 200, await self._answer(scope, body)
        except FloorRefused as exc:
            status, answer = 409, pydantic_core.to_json({"error": {"reason": "refused", "message": str(exc)}})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})

    async def _answer(self, scope: dict[str, Any], body: bytes) -> bytes:
        path = scope["path"]
        if path == "/openapi.json":
            return self._OPENAPI
        conn = await self._connection()
        try:
            match = self._BEGIN_PATH.match(path) or self._LEASE_PATH.match(path) or self._COMMIT_PATH.match(path) \
                or self._GENERATIONS_PATH.match(path)
            if match is None or scope["method"] != "POST":
                raise FloorRefused(f"not a call of the floor: {scope['method']} {path}")
            name = match.group(1)
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if name not in self.tokens:  # registered since the last read (a run's sinks come per shape)
                with psycopg.connect(self.url, autocommit=True) as reader:
                    self.tokens = dict(reader.execute(f"SELECT name, token FROM {SCHEMA}.sinks").fetchall())
            if self.tokens.get(name) is None or auth != b"Bearer " + self.tokens[name].encode():
                raise FloorRefused("unknown sink or token")
            request = pydantic_core.from_json(body)
            if match.re is self._GENERATIONS_PATH:
                return pydantic_core.to_json({"generation": 1})
            generation = str(request["generation"]).encode()
            if match.re is self._BEGIN_PATH:
                batch = int(match.group(2))
                partitions = int(request["partitions"])
                _, row = await conn.run([
                    (b"BEGIN", None),
                    (_LOCK_SINK[0], [name.encode(), generation]),
                    (_BEGIN[0], [name.encode(), b"%d" % batch, b"%d" % partitions, generation]),
                    (b"COMMIT", None),
                ])
                if row is None:
                    raise FloorRefused("not a new batch of the sink's generation, or another is unfinished")
                tids, deadline = pydantic_core.from_json(row[0]), row[1].decode()
                return pydantic_core.to_json({"action": "write", "attempt": 1, "deadline_at": deadline,
                                              "pre_leased": len(tids)})
            batch, attempt = int(match.group(2)), int(match.group(3))
            if match.re is self._LEASE_PATH:
                partition = int(request["partition"])
                (row,) = await conn.run([(_CLAIM[0], [name.encode(), b"%d" % batch, b"%d" % partition,
                                                      b"%d" % int(request["task_attempt_id"]), generation])])
                if row is None:
                    raise FloorRefused("not an OPEN batch of the sink's generation, or the partition is claimed")
                return pydantic_core.to_json({"lease_id": FIRST_TRY_ID_BASE + batch * 4096 + partition,
                                              "transactional_id": row[0].decode(), "partition": partition})
            winners = request["partitions"]
            (row,) = await conn.run([(_DECIDE[0], [name.encode(), b"%d" % batch, b"%d" % attempt, generation,
                                                   pydantic_core.to_json(winners)])])
            if row is None:
                raise FloorRefused("not an OPEN attempt of the sink's generation outside the margin")
            # (the coordinator commits each winner on Kafka here)
            await conn.run([(b"BEGIN", None), (_ASYNC_COMMIT, None), (_MARK[0], [row[0], b"%d" % batch]),
                            (b"COMMIT", None)])
            return pydantic_core.to_json({"state": "COMMITTED", "committed": [
                {"partition": w["partition"], "lease_id": w["lease_id"]} for w in winners]})
        finally:
            assert self.pool is not None
            self.pool.put_nowait(conn)


def app_from_env() -> FloorApp:
    return FloorApp(os.environ["STACK_FLOOR_DATABASE_URL"], int(os.environ.get("STACK_FLOOR_CONNECTIONS", "8")))


def create_schema(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(DDL)


def register(url: str, names: list[str], partitions: int) -> list[dict[str, str]]:
    """Sinks of the floor, each with a pool of `partitions` ids; the load's sink entries."""
    out = []
    with psycopg.connect(url, autocommit=True) as conn:
        for name in names:
            token = secrets.token_urlsafe(16)
            conn.execute(f"INSERT INTO {SCHEMA}.sinks (name, token, generation, timeout_ms, pool) "
                         "VALUES (%s, %s, 1, %s, %s)", (name, token, TIMEOUT_MS,
                                                         [f"tx-{name}-{k}" for k in range(partitions)]))
            out.append({"name": name, "token": token})
    return out


def check_record(url: str, names: list[str], cycles_total: int) -> dict[str, Any]:
    """After a run: every cycle a driver saw complete is a COMMITTED batch of the floor, nothing
    else is left (the floor is measured only if it wrote what it answered)."""
    with psycopg.connect(url, autocommit=True) as conn:
        committed, other = conn.execute(
            f"SELECT count(*) FILTER (WHERE b.state = 'COMMITTED'), count(*) FILTER (WHERE b.state <> 'COMMITTED') "
            f"FROM {SCHEMA}.batches AS b JOIN {SCHEMA}.sinks AS s ON s.id = b.sink_id WHERE s.name = ANY(%s)",
            (names,)).fetchone()
    return {"committed_batches": committed, "cycles_completed_by_drivers": cycles_total,
            "batches_not_committed": other, "ok": committed == cycles_total and other == 0}


class FloorServer:
    """The floor app under uvicorn as `coordinator serve` runs its own, in a process group of its
    own."""

    def __init__(self, url: str, workers: int, connections: int, log_path: Path) -> None:
        from protocol_clients import free_port

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, STACK_FLOOR_DATABASE_URL=url, STACK_FLOOR_CONNECTIONS=str(connections),
                   PYTHONPATH=os.pathsep.join([str(BENCH), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.log_file = open(log_path, "ab")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(self.port), str(workers)],
            env=env, cwd=str(BENCH), stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while log_path.read_bytes().count(b"Application startup complete") < workers:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stack floor's server did not start; see {log_path}")
            time.sleep(0.1)

    def stop(self) -> None:
        from protocol_clients import stop_group

        stop_group(self.proc)
        self.log_file.close()


# uvicorn as `coordinator serve` configures it (coordinator/cli/command.py)
_SERVE = """
import sys, uvicorn
uvicorn.run("stack_floor:app_from_env", factory=True, host="127.0.0.1", port=int(sys.argv[1]),
            workers=int(sys.argv[2]), log_level="info", loop="uvloop", http="httptools", access_log=False)
"""
