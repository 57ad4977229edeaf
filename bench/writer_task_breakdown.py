#!/usr/bin/env python
"""Where one exactly-once task's time goes, step by step (no Spark: the executor's `write_task` on
Arrow record batches, run in one process as a reused Python worker runs its tasks one after another).

Per batch: `begin` (driver), then --partitions tasks of --records records each (each try asks the
lease route for its id with its task attempt id), then `commit` (driver; it carries every task's
pre-commit record, and the coordinator commits every winner by EndTxn). Each step is timed by
wrapping the functions the executor calls; `rest` is what the steps do not cover (mostly releasing
the producer: destroying librdkafka's instance and joining its threads). After each task the bench
runs `gc.collect()` as PySpark's daemon does between the tasks of a reused worker (`gc_after_task`;
the first task froze the worker's heap: sparkclient/executor.py). Prints the median per step over
all measured tasks (the first batch is a warm-up and not counted).

    python bench/writer_task_breakdown.py                         # 6 batches x 4 tasks x 25k records
    python bench/writer_task_breakdown.py --records 100000 --batches 4
"""

from __future__ import annotations

import argparse
import gc
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
import pyarrow as pa  # noqa: E402

import writer_paths  # noqa: E402
from sparkclient import CoordinatorClient, transaction  # noqa: E402
from sparkclient.executor import BatchAttempt, Coordinator, TaskSpec, TaskTry, WriteSettings, write_task  # noqa: E402
from sparkclient.options import PRODUCER_DEFAULTS  # noqa: E402

STEPS = ("lease", "producer", "init_transactions", "begin_transaction", "produce", "flush", "producer_id_epoch",
         "rest")
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
    confluent_kafka.Producer = TimedProducer  # sparkclient.transaction imports it at call time
    transaction.produce_batches = timed("produce", transaction.produce_batches)
    transaction.EosLog.producer_id_and_epoch = timed("producer_id_epoch",  # type: ignore[method-assign]
                                                     transaction.EosLog.producer_id_and_epoch)
    CoordinatorClient.lease = timed("lease", CoordinatorClient.lease)  # type: ignore[method-assign]


def record_batches(records: int, value: str) -> list[Any]:
    keys = [str(i) for i in range(records)]
    return [pa.record_batch([pa.array(keys[i:i + 10_000]), pa.array([value] * len(keys[i:i + 10_000]))],
                            names=["key", "value"]) for i in range(0, records, 10_000)]


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
        kafka, bootstrap = writer_paths.start_kafka(workdir)
        procs.append(kafka)
        coordinator, url, admin_token = writer_paths.start_coordinator(workdir)
        procs.append(coordinator)
        topic = writer_paths.create_topic(bootstrap, 6)
        with CoordinatorClient(url, admin_token, "breakdown") as admin:
            token = admin.register_sink("breakdown-tx", bootstrap, [topic], transaction_timeout_ms=300_000)["writer_token"]
        instrument()
        data = record_batches(args.records, "x" * 100)
        settings = WriteSettings(Coordinator(url, token, "breakdown", 30_000, 120_000), bootstrap, producer_config,
                                 topic, ("key", "value"), False)
        driver_steps: dict[str, list[float]] = defaultdict(list)
        task_id = 0
        with CoordinatorClient(url, token, "breakdown") as driver:
            generation = driver.start_generation("breakdown-query", "run-1")["generation"]
            for batch in range(args.batches):
                started = time.perf_counter()
                answer = driver.begin(batch, generation)
                begun = time.perf_counter()
                spec = TaskSpec(settings, BatchAttempt.of_begin(batch, generation, answer))
                winners, records = {}, {}
                for partition in range(args.partitions):
                    current.clear()
                    task_id += 1
                    task_started = time.perf_counter()
                    result = write_task(spec, TaskTry(partition, task_id, 0), data)
                    total = time.perf_counter() - task_started
                    collected = time.perf_counter()
                    gc.collect()  # what PySpark's daemon does after every task of a reused worker
                    gc_s = time.perf_counter() - collected
                    winners[partition] = result.lease_id
                    records[partition] = result.precommit_record()
                    if batch > 0:
                        for name in STEPS[:-1]:
                            times[name].append(current.get(name, 0.0))
                        times["rest"].append(total - sum(current.values()))
                        times["task"].append(total)
                        times["gc_after_task"].append(gc_s)
                committing = time.perf_counter()
                answer = driver.commit(batch, answer["attempt"], generation, winners, records=records)
                if answer["state"] != "COMMITTED":
                    raise SystemExit(f"batch {batch}: commit answered {answer['state']}")
                if batch > 0:
                    driver_steps["begin"].append(begun - started)
                    driver_steps["commit"].append(time.perf_counter() - committing)
        print(f"{args.batches - 1} measured batches x {args.partitions} tasks x {args.records} records "
              f"(Apache Kafka {kafka.version}, one node; coordinator on embedded Postgres; same machine)"
              + (f"; producer {' '.join(args.producer)}" if args.producer else ""))
        print(f"{'step (per task)':>22} {'median ms':>10} {'max ms':>8}")
        for name in (*STEPS, "task", "gc_after_task"):
            print(f"{name:>22} {statistics.median(times[name]) * 1000:10.1f} {max(times[name]) * 1000:8.1f}")
        for name, values in driver_steps.items():
            print(f"{name + ' (per batch)':>22} {statistics.median(values) * 1000:10.1f} {max(values) * 1000:8.1f}")
        return 0
    finally:
        writer_paths.stop_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
