"""Verify the example job's output topic as a downstream `read_committed` consumer would see it.

    python -m e2e.verify_output --bootstrap-servers kafka:9092 --topic exactly-once-demo \
        --total-records 3000 --prefix demo- [--dump out.jsonl]
    python -m e2e.verify_output --from-dump out.jsonl --total-records 3000 --prefix demo-

First it waits (up to --settle-timeout-s) until the broker lists no open transaction under the
sink's `transactional.id` prefix (KIP-664 ListTransactions through the coordinator's own wire
client; the coordinator's recovery loop aborts lingering ones), then reads every partition from
the beginning with `isolation.level=read_committed` up to its end (the last stable offset:
librdkafka reports a read_committed partition's end there), asks the broker for each partition's
last stable offset and high watermark (ListOffsets), and hands all of it to the pure checker
(`e2e/checker.py`). Prints the verdict (and `--json`) and exits 0 on PASS, 1 on FAIL,
2 when it could not look (broker unreachable, no listing support).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

from coordinator.kafka.control_plane import ControlPlaneError, KafkaTarget, OpenTransaction

from .checker import Record, check, expected_range, read_dump, write_dump


def consume_topic(bootstrap_servers: str, topic: str, *, timeout_s: float = 120.0, idle_s: float = 3.0,
                  client_config: dict[str, str] | None = None) -> list[Record]:
    """Every record of every partition of `topic` that a read_committed consumer gets, from the
    beginning to the end each partition has when it is reached (its last stable offset), then
    `idle_s` more with nothing new. Raises TimeoutError if the end is not reached in time."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": bootstrap_servers,
        "group.id": f"e2e-verify-{uuid.uuid4().hex[:8]}",  # never commits: a fresh group each time
        "isolation.level": "read_committed",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        **(client_config or {}),
    })
    try:
        meta = consumer.list_topics(topic, timeout=30)
        tmeta = meta.topics.get(topic)
        if tmeta is None or tmeta.error is not None or not tmeta.partitions:
            raise LookupError(f"topic {topic!r} not found on {bootstrap_servers} "
                              f"({tmeta.error if tmeta is not None else 'no metadata'})")
        partitions = sorted(tmeta.partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        records: list[Record] = []
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        last_new = time.monotonic()
        while True:
            msg = consumer.poll(0.5)
            now = time.monotonic()
            if msg is not None:
                err = msg.error()
                if err is None:
                    records.append(Record(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(),
                                          tuple((k, v) for k, v in (msg.headers() or []))))
                    at_end.discard(msg.partition())
                    last_new = now
                elif err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
                else:
                    raise RuntimeError(f"consumer error: {err}")
            if len(at_end) == len(partitions) and now - last_new >= idle_s:
                return records
            if now > deadline:
                raise TimeoutError(f"read_committed consumer did not reach the end of partitions "
                                   f"{sorted(set(partitions) - at_end)} of {topic!r} within {timeout_s} s "
                                   "(an open transaction holds the last stable offset?)")
    finally:
        consumer.close()


def open_transactions(bootstrap_servers: str, prefix: str, client_config: dict | None = None) -> list[OpenTransaction]:
    """The broker's open transactions under `prefix` (ListTransactions + DescribeTransactions)."""
    from coordinator.kafka.wire.control_plane import KafkaWireControlPlane

    plane = KafkaWireControlPlane(request_timeout_ms=10_000, retry_budget_ms=30_000, client_config=client_config)
    try:
        return plane.list_open_transactions(KafkaTarget("e2e-verify", bootstrap_servers, 60_000), prefix)
    finally:
        plane.close()


def unstable_partitions(bootstrap_servers: str, topic: str, client_config: dict | None = None) -> list[str]:
    """Partitions whose last stable offset is below the high watermark, as the broker reports them."""
    from coordinator.kafka.wire.control_plane import KafkaWireControlPlane

    plane = KafkaWireControlPlane(request_timeout_ms=10_000, retry_budget_ms=30_000, client_config=client_config)
    try:
        rows = plane.partition_stability(KafkaTarget("e2e-verify", bootstrap_servers, 60_000), [topic])
    finally:
        plane.close()
    return [f"{r.topic}[{r.partition}] last stable offset {r.last_stable_offset} < high watermark {r.high_watermark}"
            + (f" (held by producer id {r.blocking_producer_id})" if r.blocking_producer_id is not None else "")
            for r in rows if r.last_stable_offset < r.high_watermark]


def wait_until_no_open_transactions(bootstrap_servers: str, prefix: str, timeout_s: float) -> list[OpenTransaction]:
    """Poll the listing until it is empty or `timeout_s` passed; returns the last listing."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = open_transactions(bootstrap_servers, prefix)
        if not listed or time.monotonic() > deadline:
            return listed
        time.sleep(2.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m e2e.verify_output", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bootstrap-servers", help="Kafka bootstrap servers, e.g. kafka:9092")
    src.add_argument("--from-dump", type=Path, help="check a recorded topic dump (JSON lines) instead of a broker")
    p.add_argument("--topic", default="exactly-once-demo")
    p.add_argument("--total-records", type=int, required=True, help="the job's TOTAL_RECORDS: expect '0'..'N-1'")
    p.add_argument("--prefix", default="demo-", help="the sink's transactional.id prefix")
    p.add_argument("--settle-timeout-s", type=float, default=180.0,
                   help="how long to wait for open transactions under the prefix to end")
    p.add_argument("--read-timeout-s", type=float, default=180.0)
    p.add_argument("--dump", type=Path, help="also write what was read to this file (JSON lines)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON too")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.total_records < 0:
        p.error("--total-records must be >= 0")

    unstable: list[str] = []
    if args.from_dump is not None:
        records, listed = read_dump(args.from_dump)
    else:
        try:
            listed = wait_until_no_open_transactions(args.bootstrap_servers, args.prefix, args.settle_timeout_s)
            records = consume_topic(args.bootstrap_servers, args.topic, timeout_s=args.read_timeout_s)
            unstable = unstable_partitions(args.bootstrap_servers, args.topic)
        except (ControlPlaneError, LookupError, TimeoutError, RuntimeError) as exc:
            print(f"cannot verify: {exc}", file=sys.stderr)
            return 2
        if args.dump is not None:
            write_dump(args.dump, records, listed)
    verdict = check(records, expected_range(args.total_records), listed, prefix=args.prefix, key_equals_value=True,
                    unstable_partitions=unstable)
    print(verdict.report())
    if args.json:
        print(json.dumps(verdict.as_dict()))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
