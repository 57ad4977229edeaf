#!/usr/bin/env python
"""N resume-commits (EndTxn) on a real Kafka broker by the coordinator's control plane
(`KafkaWireControlPlane`), two ways, alternating in one run:

- `calls`: one `commit` per transaction from 16 threads (the coordinator's `kafka_parallelism`),
  as the service calls a control plane without passes: each EndTxn handed to kafka-python's IO
  thread and back;
- `pass`: one `commit_all` for the N transactions: one coroutine on the IO thread runs them, 16 at
  a time (coordinator/kafka/wire/passes.py), as the service commits a batch's winners now.

For each N, round and way, N transactions are opened by producers in worker processes (flushed,
then left open: the processes exit without committing) on a fixed set of N transactional ids (a
sink's pool: a running coordinator has their coordinators cached), then committed; the figures are
the commit phase's wall time and this process's CPU time per EndTxn (all its threads: the
control plane's work, none of the producers'). Every transaction must end committed, read
back with a read_committed consumer. The first round of each N is a warm-up (connections, lookups).

    python bench/end_txn_bench.py                      # starts a single-node Kafka (localkafka/)
    python bench/end_txn_bench.py --bootstrap 127.0.0.1:9092 --sizes 8 64 200

Last lines: `end_txn N=… calls_cpu_ms_per_end_txn=… pass_cpu_ms_per_end_txn=… cpu_ratio=…
calls_wall_ms=… pass_wall_ms=…` (medians over the measured rounds; ratio = pass / calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.kafka.control_plane import KafkaTarget, PreparedTransaction  # noqa: E402
from coordinator.kafka.wire.control_plane import KafkaWireControlPlane  # noqa: E402

THREADS = 16  # the coordinator's kafka_parallelism

# opens transactions for the ids given, one partition each, prints {"tid", "pid", "epoch"} lines,
# exits without committing
_OPENER = r"""
import json, os, sys, time
from confluent_kafka import Producer
bootstrap, topic, partitions, ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
for i, tid in ids:
    seen = {}
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, "statistics.interval.ms": 10,
                  "stats_cb": lambda raw: seen.update(json.loads(raw).get("eos") or {}), "log_level": 0})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(topic, value=tid.encode(), partition=i % partitions)
    assert p.flush(30) == 0
    seen.clear()
    deadline = time.monotonic() + 10
    while seen.get("producer_id", -1) < 0 and time.monotonic() < deadline:
        p.poll(0.01)
    sys.stdout.write(json.dumps({"tid": tid, "pid": seen["producer_id"], "epoch": seen["producer_epoch"]}) + "\n")
    sys.stdout.flush()
    # the next id's producer is a new instance; this one is left as it is (never committed)
os._exit(0)
"""


def open_transactions(bootstrap: str, topic: str, partitions: int, ids: list[tuple[int, str]],
                      workers: int = 4) -> list[PreparedTransaction]:
    procs = [subprocess.Popen([sys.executable, "-c", _OPENER, bootstrap, topic, str(partitions),
                               json.dumps(ids[w::workers])], stdout=subprocess.PIPE, text=True)
             for w in range(workers)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"an opener failed ({p.returncode})")
        out += [json.loads(line) for line in stdout.splitlines()]
    assert len(out) == len(ids), (len(out), len(ids))
    return [PreparedTransaction(x["tid"], x["pid"], x["epoch"]) for x in out]


def commit(plane: KafkaWireControlPlane, target: KafkaTarget, txns: list[PreparedTransaction], way: str,
           threads: int = THREADS) -> tuple[float, float]:
    """Commit every transaction one way; (wall seconds, this process's CPU seconds)."""
    c0, w0 = time.process_time(), time.perf_counter()
    if way == "pass":
        failed = [o.error for o in plane.commit_all(target, txns, threads) if o.error is not None]
        if failed:
            raise SystemExit(f"{len(failed)} commits failed, e.g. {failed[0]}")
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda t: plane.commit(target, t), txns))
    return time.perf_counter() - w0, time.process_time() - c0


def visible(bootstrap: str, topic: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from fixtures.real_kafka import read_committed

    return len(read_committed(bootstrap, topic, 120))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", help="an existing Kafka (default: start one with localkafka)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 200])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds of each way per size (default 3)")
    ap.add_argument("--transaction-version", type=int, default=2, choices=(1, 2))
    args = ap.parse_args()
    cluster = None
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        from localkafka import LocalKafka

        cluster = LocalKafka(tempfile.mkdtemp(prefix="end-txn-bench-"), transaction_version=args.transaction_version)
        cluster.start()
        bootstrap = cluster.bootstrap_servers
    plane = KafkaWireControlPlane()
    target = KafkaTarget("bench", bootstrap, 60_000)
    try:
        from confluent_kafka.admin import AdminClient, NewTopic

        topic = f"end-txn-bench-{uuid.uuid4().hex[:6]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, 8, 1)])[topic].result(30)
        print(f"broker {bootstrap}; {args.rounds} measured rounds per way after one warm-up; {THREADS} at a time; "
              "wall time and this process's CPU of N EndTxn")
        print(f"{'N':>5} {'calls wall':>11} {'pass wall':>10} {'calls CPU/EndTxn':>17} {'pass CPU/EndTxn':>16}   ratio")
        committed, lines = 0, []
        for n in args.sizes:
            ids = [(i, f"bench-{uuid.uuid4().hex[:8]}-{i}") for i in range(n)]
            figures: dict[str, list[tuple[float, float]]] = {"calls": [], "pass": []}
            for r in range(args.rounds + 1):
                for way in ("calls", "pass") if r % 2 == 0 else ("pass", "calls"):
                    wall, cpu = commit(plane, target, open_transactions(bootstrap, topic, 8, ids), way)
                    committed += n
                    if r:
                        figures[way].append((wall, cpu))
            med = {way: (statistics.median(w for w, _ in f) * 1000, statistics.median(c for _, c in f) * 1000 / n)
                   for way, f in figures.items()}
            ratio = med["pass"][1] / med["calls"][1]
            print(f"{n:>5} {med['calls'][0]:>8.0f} ms {med['pass'][0]:>7.0f} ms {med['calls'][1]:>14.3f} ms "
                  f"{med['pass'][1]:>13.3f} ms   {ratio:.2f}x", flush=True)
            lines.append(f"end_txn N={n} calls_cpu_ms_per_end_txn={med['calls'][1]:.3f} "
                         f"pass_cpu_ms_per_end_txn={med['pass'][1]:.3f} cpu_ratio={ratio:.2f} "
                         f"calls_wall_ms={med['calls'][0]:.0f} pass_wall_ms={med['pass'][0]:.0f}")
        seen = visible(bootstrap, topic)
        print(f"read_committed sees {seen} records of {committed} committed transactions "
              f"({'ok' if seen == committed else 'MISMATCH'})")
        for line in lines:
            print(line)
        return 0 if seen == committed else 1
    finally:
        plane.close()
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
