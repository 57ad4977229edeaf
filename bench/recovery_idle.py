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
for p in (str(BENCH), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

from measure import cpu_seconds, cpu_snapshot, figure_line, log, pg_counters, start_embedded_postgres  # noqa: E402
from protocol_clients import Server  # noqa: E402


def add_idle_sinks(url: str, first: int, count: int, bootstrap: str) -> None:
    """Sinks idle-0000.. registered, each with a generation and one committed 2-partition batch."""
    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.protocol.model import PartitionResult, PrecommitRecord
    from coordinator.service import Coordinator, SinkSpec
    from coordinator.store.db import make_engine

    engine = make_engine(url, pool_size=2)
    c = Coordinator(engine, RecordingControlPlane(keep_history=False))
    try:
        for i in range(first, first + count):
            name = f"idle-{i:05d}"
            c.register_sink(SinkSpec(name, f"tx-{name}", bootstrap, ["idle"]), "bench", check_broker=False)
            generation, _ = c.start_generation(name, "q", "r", "bench")
            begun = c.begin_checkpoint(name, 0, generation, "bench", partitions=2)
            won = [c.lease(name, 0, begun.attempt.number, generation, p, p).lease for p in range(2)]
            results = [PartitionResult(x.partition, x.id, PrecommitRecord(x.task_attempt_id, 1000 + x.partition, 0, 1, 100))
                       for x in won]
            if c.commit(name, 0, begun.attempt.number, generation, results, "bench").checkpoint.state != "COMMITTED":
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
    args = ap.parse_args(argv)
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
        server = Server(url, args.workers, 5, "info", tmp / "server.log", control_plane=args.control_plane)
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
    print(f"\nrecovery_idle: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"coordinator serve --workers {args.workers}, recovery loop on, {args.seconds:.0f} s windows")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
