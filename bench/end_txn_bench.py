#!/usr/bin/env python
"""N parallel resume-commits (EndTxn) on a real Kafka broker, by the coordinator's control plane
(`KafkaWireControlPlane`), with 1 request in flight per connection vs kafka-python's pipelining
(`max_in_flight_requests_per_connection`, default 5), each from 16 threads (the coordinator's
`kafka_parallelism`).

For each N and setting, N transactions are opened by producers in worker processes (flushed, then
left open: the processes exit without committing), then committed in parallel; the figure is the
wall time of that commit phase and the broker's COMMIT answers (every transaction must end
committed, read back with a read_committed consumer).

    python bench/end_txn_bench.py                      # starts a single-node Kafka (localkafka/)
    python bench/end_txn_bench.py --bootstrap 127.0.0.1:9092 --sizes 8 64 200
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


def open_transactions(bootstrap: str, topic: str, partitions: int, n: int, workers: int = 4) -> list[PreparedTransaction]:
    run = uuid.uuid4().hex[:8]
    ids = [(i, f"bench-{run}-{i}") for i in range(n)]
    procs = [subprocess.Popen([sys.executable, "-c", _OPENER, bootstrap, topic, str(partitions),
                               json.dumps(ids[w::workers])], stdout=subprocess.PIPE, text=True)
             for w in range(workers)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"an opener failed ({p.returncode})")
        out += [json.loads(line) for line in stdout.splitlines()]
    assert len(out) == n, (len(out), n)
    return [PreparedTransaction(x["tid"], x["pid"], x["epoch"]) for x in out]


def commit_all(bootstrap: str, txns: list[PreparedTransaction], in_flight: int, threads: int = 16) -> float:
    plane = KafkaWireControlPlane(client_config={"max_in_flight_requests_per_connection": in_flight})
    target = KafkaTarget("bench", bootstrap, 60_000)
    try:
        plane.commit(target, txns[0])  # connect, find the coordinator once (not timed)
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda t: plane.commit(target, t), txns[1:]))
        return time.perf_counter() - started
    finally:
        plane.close()


def visible(bootstrap: str, topic: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from fixtures.real_kafka import read_committed

    return len(read_committed(bootstrap, topic, 120))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", help="an existing Kafka (default: start one with localkafka)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 200])
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--rounds", type=int, default=2)
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
    try:
        from confluent_kafka.admin import AdminClient, NewTopic

        topic = f"end-txn-bench-{uuid.uuid4().hex[:6]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, 8, 1)])[topic].result(30)
        print(f"broker {bootstrap}; {args.rounds} rounds; 16 threads; wall time of N-1 parallel EndTxn "
              "(after one untimed to connect)")
        print(f"{'N':>5} " + " ".join(f"{'inflight=' + str(m):>14}" for m in args.in_flight) + "   ratio")
        committed = 0
        for n in args.sizes:
            walls: dict[int, list[float]] = {m: [] for m in args.in_flight}
            for _ in range(args.rounds):
                for m in args.in_flight:
                    txns = open_transactions(bootstrap, topic, 8, n)
                    walls[m].append(commit_all(bootstrap, txns, m))
                    committed += n
            med = {m: statistics.median(w) * 1000 for m, w in walls.items()}
            ratio = med[args.in_flight[0]] / med[args.in_flight[-1]]
            print(f"{n:>5} " + " ".join(f"{med[m]:>11.0f} ms" for m in args.in_flight) + f"   {ratio:.2f}x", flush=True)
        seen = visible(bootstrap, topic)
        print(f"read_committed sees {seen} records of {committed} committed transactions "
              f"({'ok' if seen == committed else 'MISMATCH'})")
        return 0 if seen == committed else 1
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
