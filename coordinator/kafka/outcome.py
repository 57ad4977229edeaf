"""Did a transaction commit? Asked of the partition log, as a read_committed consumer sees it.

Before the coordinator declares a refused commit LOST it reads each partition the transaction
wrote at the offset of the transaction's first record there (the executor reports it with its
pre-commit). A read_committed consumer positioned at that offset either gets that very record
back (the transaction committed: its EndTxn was applied even though a later retry was refused,
e.g. after the answer was lost and the id was initialised again), or skips it once the last
stable offset is past it (the transaction aborted). Anything else -- the offset at or above the
last stable offset (the transaction or an older one is still open), below the log start
(retention deleted it), an unreachable broker -- is UNKNOWN and decides nothing.

kafka-python's KafkaConsumer does the reading (no consumer group, manual assignment), with the
coordinator's Kafka client settings (security) where the consumer accepts them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from .control_plane import FirstOffset, TransactionOutcome, combine_outcomes

log = logging.getLogger(__name__)


def read_committed_outcome(
    bootstrap_servers: str, first_offsets: Sequence[FirstOffset], client_config: dict[str, Any], timeout_ms: int
) -> TransactionOutcome:
    if not first_offsets:
        return TransactionOutcome.UNKNOWN
    config = {k: v for k, v in client_config.items() if k in KafkaConsumer.DEFAULT_CONFIG}
    config.update(bootstrap_servers=bootstrap_servers, isolation_level="read_committed", enable_auto_commit=False,
                  group_id=None, request_timeout_ms=max(timeout_ms, 1_000), fetch_max_wait_ms=100)
    try:
        consumer = KafkaConsumer(**config)
    except Exception as exc:  # noqa: BLE001 - an unreachable broker decides nothing
        log.warning("read_committed check: cannot connect to %s: %s", bootstrap_servers, exc)
        return TransactionOutcome.UNKNOWN
    try:
        return combine_outcomes([_read_one(consumer, tp, timeout_ms) for tp in first_offsets])
    except Exception as exc:  # noqa: BLE001
        log.warning("read_committed check of %s failed: %s", list(first_offsets), exc)
        return TransactionOutcome.UNKNOWN
    finally:
        consumer.close()


def _read_one(consumer: KafkaConsumer, position: FirstOffset, timeout_ms: int) -> TransactionOutcome:
    topic, partition, offset = position
    tp = TopicPartition(topic, partition)
    consumer.assign([tp])
    start = consumer.beginning_offsets([tp], timeout_ms=timeout_ms)[tp]
    stable = consumer.end_offsets([tp], timeout_ms=timeout_ms)[tp]  # read_committed: the last stable offset
    if not start <= offset < stable:
        return TransactionOutcome.UNKNOWN
    consumer.seek(tp, offset)
    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
        for record in consumer.poll(timeout_ms=200).get(tp, []):
            return TransactionOutcome.COMMITTED if record.offset == offset else TransactionOutcome.ABORTED
        if consumer.position(tp) >= stable:  # everything up to the stable offset skipped: aborted
            return TransactionOutcome.ABORTED
    return TransactionOutcome.UNKNOWN
