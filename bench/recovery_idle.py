#!/usr/bin/env python
"""What an idle deployment costs (issue 50 §1): `coordinator serve` as deployed (uvicorn
--workers, its recovery loop on), N registered sinks that each ran a batch and are now idle, and
the CPU the server's processes and Postgres use per second over a window, from /proc; plus
Postgres transactions per second. The sinks are added between the windows (10, then 100, then
1,000 in all by default), so one server sees every N in turn.

The sinks are registered and run their batch in this process (the coordinator's own
`Coordinator`, record-only control plane), straight into the server's database: the server is
then left alone. Its control plane is "none" by default (the record-only plane: Kafka passes cost
nothing, so the figure is the loop's own work), or "kafka" against a broker started with
localkafka (--control-plane kafka: the sweep then lists the broker's open transactions once per
cluster every sweep interval). A window should hold at least one sweep (30 s by default).

    python bench/recovery_idle.py                        # N = 10, 100, 1000; 30 s windows (~4 min)
    python bench/recovery_idle.py --sinks 10 100 --seconds 10
    python bench/recovery_idle.py --control-plane kafka
    python bench/recovery_idle.py --code /work/baseline  # another checkout's coordinator (server and sinks)

One line per N:
    idle sinks=100 server_cpu_ms_per_s=… postgres_cpu_ms_per_s=… xacts_per_s=… seconds=…
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last: a checkout named by --code (on PYTHONPATH) comes first

from measure import cpu_seconds, cpu_snapshot, figure_line, log, pg_counters, start_embedded_postgres  # noqa: E402
from protocol_clients import InprocessSink, Record, Server  # noqa: E402


def add_idle_sinks(url: str, first: int, count: int, bootstrap: str) -> None:
    """Sinks idle-0000.. registered, each with a generation and one committed 2-partition batch
    (as the writer runs it on the code imported: first tries claim their pre-leases, or, before the
    rebuild, write on them without a call)."""
    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.service import Coordinator, SinkSpec
    from coordinator.store.db import make_engine

    engine = make_engine(url, pool_size=2)
    c = Coordinator(engine, RecordingControlPlane(keep_history=False))
    try:
        for i in range(first, first + count):
            name = f"idle-{i:05d}"
            c.register_sink(SinkSpec(name, f"tx-{name}", bootstrap, ["idle"]), "bench", check_broker=False)
            sink = InprocessSink(c, name)
            generation = sink.start_generation("q", "r")
            begun = sink.begin(0, generation, 2)
            assert begun.attempt is not None
            won = [sink.lease(0, begun.attempt, generation, p, p)[0] for p in range(2)] if sink.claims \
                else [lid for _, lid, _ in sorted(begun.pre_leases)]
            if sink.commit(0, begun.attempt, generation, list(enumerate(won)),
                           [Record(p, 1000 + p, 0, 1) for p in range(2)]) != 2:
                raise RuntimeError(f"{name}: its batch did not commit")
    finally:
        c.close()
        engine.dispose()


def measure_window(url: str, server_pid: int, postgres_pid: int | None, seconds: float) -> dict[str, float]:
    a, (c0, r0, _), t0 = cpu_snapshot(server_pid, postgres_pid), pg_counters(url), time.monotonic()
    time.sleep(seconds)
    b, t1 = cpu_snapshot(server_pid, postgres_pid), time.monotonic()
    time.sleep(1.1)  # backends flush their transaction counters about once a second
    c1, r1, _ = pg_counters(url)
    used = cpu_seconds(a, b)
    wall = t1 - t0
    return {"server_cpu_ms_per_s": used["server"] * 1000 / wall, "postgres_cpu_ms_per_s": used["postgres"] * 1000 / wall,
            # less the two counter queries of this window
            "xacts_per_s": max(0, c1 - c0 + r1 - r0 - 2) / wall, "seconds": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sinks", type=int, nargs="+", default=[10, 100, 1000], help="N in increasing order")
    ap.add_argument("--seconds", type=float, default=30, help="window per N (default 30: one sweep interval)")
    ap.add_argument("--settle", type=float, default=5, help="unmeasured seconds after adding sinks (default 5)")
    ap.add_argument("--workers", type=int, default=2, help="uvicorn workers (default 2, as deployed)")
    ap.add_argument("--control-plane", choices=("none", "kafka"), default="none")
    ap.add_argument("--database-url", help="an empty Postgres database to use instead of an embedded one")
    ap.add_argument("--code", type=Path, help="the checkout whose coordinator runs (default: this one)")
    args = ap.parse_args(argv)
    if args.code and os.environ.get("RECOVERY_IDLE_CODE") != str(args.code.resolve()):
        # again, with that checkout's coordinator first on the path (its server gets it too)
        code = str(args.code.resolve())
        env = {**os.environ, "RECOVERY_IDLE_CODE": code, "PYTHONPATH": os.pathsep.join([code, str(BENCH)])}
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])], env)
    if sorted(args.sinks) != args.sinks:
        ap.error("--sinks must increase")
    tmp = Path(tempfile.mkdtemp(prefix="recovery-idle-"))
    os.chmod(tmp, 0o755)
    pg = postgres_pid = server = cluster = None
    lines = []
    try:
        if args.database_url:
            url = args.database_url
        else:
            pg, url = start_embedded_postgres(tmp, 200)
            postgres_pid = pg.get_pid()
        from coordinator.store.db import migrate

        migrate(url)
        bootstrap = "localhost:9092"
        if args.control_plane == "kafka":
            from localkafka import LocalKafka

            log("starting a Kafka broker (localkafka)")
            cluster = LocalKafka(tmp / "kafka", heap="512m")
            cluster.start()
            bootstrap = cluster.bootstrap_servers
        log(f"starting coordinator serve --workers {args.workers} (control plane {args.control_plane}, recovery on)")
        server = Server(url, args.workers, 5, "info", tmp / "server.log", control_plane=args.control_plane,
                        code=args.code.resolve() if args.code else ROOT)
        have = 0
        for n in args.sinks:
            log(f"adding {n - have} idle sinks ({n} in all)")
            add_idle_sinks(url, have, n - have, bootstrap)
            have = n
            time.sleep(args.settle)
            figures = measure_window(url, server.proc.pid, postgres_pid, args.seconds)
            lines.append(figure_line("idle", sinks=n, control_plane=args.control_plane, **figures))
            log(lines[-1])
    finally:
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.stop()
        if pg is not None:
            pg.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    import coordinator

    print(f"\nrecovery_idle: {Path(coordinator.__file__).parent.parent}, {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"coordinator serve --workers {args.workers}, recovery loop on, {args.seconds:.0f} s windows")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
