#!/usr/bin/env python
"""Where one exactly-once task's time goes, step by step (no Spark: the executor's
`write_partition` run in one process, as a reused Python worker runs its tasks one after another).

Per batch: `begin` (driver; it pre-leases every partition's first try), then --partitions tasks
of --records records each (first tries: no coordinator call), then `commit` (driver; it carries
every task's pre-commit record, and the coordinator commits every winner by EndTxn). Each step is timed by wrapping the
functions the executor calls; `rest` is what the steps do not cover (mostly releasing the
producer: destroying librdkafka's instance and joining its threads). Prints the median per step over
all measured tasks (the first batch is a warm-up and not counted).

    python bench/writer_task_breakdown.py                         # 6 batches x 4 tasks x 25k records
    python bench/writer_task_breakdown.py --records 100000 --batches 4
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import confluent_kafka  # noqa: E402

import writer_bench  # noqa: E402
from sparkclient import CoordinatorClient, executor  # noqa: E402
from sparkclient.options import PRODUCER_DEFAULTS  # noqa: E402

STEPS = ("client", "lease", "producer", "init_transactions", "begin_transaction", "produce", "flush",
         "producer_id_epoch", "rest")  # `lease`: a coordinator call only a retried try makes (0 here)
times: dict[str, list[float]] = defaultdict(list)
current: dict[str, float] = {}


def timed(name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            current[name] = current.get(name, 0.0) + time.perf_counter() - started
    return wrapper


class TimedProducer(confluent_kafka.Producer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        super().__init__(*args, **kwargs)
        current["producer"] = time.perf_counter() - started

    def init_transactions(self, *args: Any) -> Any:
        return timed("init_transactions", super().init_transactions)(*args)

    def begin_transaction(self, *args: Any) -> Any:
        return timed("begin_transaction", super().begin_transaction)(*args)

    def flush(self, *args: Any) -> Any:
        return timed("flush", super().flush)(*args)


def instrument() -> None:
    confluent_kafka.Producer = TimedProducer  # the executor imports it at call time
    executor._produce_rows = timed("produce", executor._produce_rows)
    executor._producer_id_and_epoch = timed("producer_id_epoch", executor._producer_id_and_epoch)
    CoordinatorClient.lease = timed("lease", CoordinatorClient.lease)  # type: ignore[method-assign]
    spec_client = executor.TaskSpec.client
    executor.TaskSpec.client = timed("client", spec_client)  # type: ignore[method-assign]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--records", type=int, default=25_000, help="records per task")
    p.add_argument("--producer", action="append", default=[], metavar="KEY=VALUE",
                   help="a librdkafka setting on top of the writer's defaults, e.g. enable.sparse.connections=false")
    args = p.parse_args()
    producer_config = dict(PRODUCER_DEFAULTS)
    for item in args.producer:
        key, _, value = item.partition("=")
        producer_config[key] = {"true": True, "false": False}.get(value.lower(), value)
    workdir = Path(tempfile.mkdtemp(prefix="writer-breakdown-"))
    procs = []
    try:
        kafka, bootstrap = writer_bench.start_kafka(workdir)
        procs.append(kafka)
        coordinator, url, admin_token = writer_bench.start_coordinator(workdir)
        procs.append(coordinator)
        topic = writer_bench.create_topic(bootstrap, 6)
        with CoordinatorClient(url, admin_token, "breakdown") as admin:
            token = admin.register_sink("breakdown-tx", bootstrap, [topic], transaction_timeout_ms=300_000)["writer_token"]
        instrument()
        value = "x" * 100
        driver_steps: dict[str, list[float]] = defaultdict(list)
        with CoordinatorClient(url, token, "breakdown") as driver:
            generation = driver.start_generation("breakdown-query", "run-1")["generation"]
            for batch in range(args.batches):
                started = time.perf_counter()
                answer = driver.begin(batch, generation, partitions=args.partitions)
                begun = time.perf_counter()
                attempt = answer["attempt"]
                spec = executor.TaskSpec(url, token, "breakdown", 30_000, 120_000, batch, attempt, generation,
                                         bootstrap, dict(producer_config), topic, ("key", "value"), False,
                                         pre_leases={x["partition"]: x for x in answer["pre_leases"]},
                                         leases_received_at=time.time(), commit_margin_ms=answer["commit_margin_ms"],
                                         max_lease_init_age_ms=answer["max_lease_init_age_ms"])
                winners, records = {}, {}
                for partition in range(args.partitions):
                    current.clear()
                    task_started = time.perf_counter()
                    rows = ((str(i), value) for i in range(args.records))
                    (result,) = list(executor.write_partition(spec, partition, rows))
                    total = time.perf_counter() - task_started
                    winners[partition] = result.lease_id
                    records[partition] = result.precommit_record()
                    if batch > 0:
                        for name in STEPS[:-1]:
                            times[name].append(current.get(name, 0.0))
                        times["rest"].append(total - sum(current.values()))
                        times["task"].append(total)
                committing = time.perf_counter()
                driver.commit(batch, attempt, generation, winners, records=records)
                if batch > 0:
                    driver_steps["begin"].append(begun - started)
                    driver_steps["commit"].append(time.perf_counter() - committing)
        print(f"{args.batches - 1} measured batches x {args.partitions} tasks x {args.records} records "
              f"(Apache Kafka {kafka.version}, one node; coordinator on embedded Postgres; same machine)"
              + (f"; producer {' '.join(args.producer)}" if args.producer else ""))
        print(f"{'step (per task)':>22} {'median ms':>10} {'max ms':>8}")
        for name in (*STEPS, "task"):
            print(f"{name:>22} {statistics.median(times[name]) * 1000:10.1f} {max(times[name]) * 1000:8.1f}")
        for name, values in driver_steps.items():
            print(f"{name + ' (per batch)':>22} {statistics.median(values) * 1000:10.1f} {max(values) * 1000:8.1f}")
        return 0
    finally:
        writer_bench.stop_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
