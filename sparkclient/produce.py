"""Arrow record batches into a producer, with the least Python per record.

Each batch's columns become Python lists in one vectorised step each (string columns are cast to
binary first, a zero-copy view, so `to_pylist()` hands out the bytes librdkafka copies), then one
loop calls `produce()` positionally per record. Constant arguments stay constant: the common case
(a `topic` option, no `partition` or `headers` column, no provenance headers) is a loop of
`produce(topic, value, key)`. Every column of Spark's Kafka sink is handled (`key`, `value`,
`topic`, `partition`, `headers`), plus the provenance headers; none falls back to a slower path.

Deliveries: the producer's one delivery callback (`on_delivery` in its configuration, so no
per-record callback argument) records failures and, for the first FIRST_OFFSETS_REPORTED
topic-partitions that deliveries reach, the offset of the first record delivered there (one
conclusive read_committed read at any record of a transaction tells whether it committed). The
caller checks `Deliveries` after `flush()`: every record acknowledged, none failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

# The record names the first offset written in this many topic-partitions: the coordinator keeps as
# many (coordinator/protocol/model.py, FIRST_OFFSETS_KEPT); a transaction over a 200-partition
# topic would otherwise add 200 entries to the driver's commit, 40,000 for 200 tasks.
FIRST_OFFSETS_REPORTED = 4
POLL_WHEN_FULL_S = 0.05  # the local queue is full: serve deliveries this long, then produce again

# Provenance headers (option provenance.headers): which sink, batch, attempt and lease (task
# attempt's transaction) wrote a record. A lease id is unique per coordinator database.
HEADER_SINK = "eos-sink"
HEADER_BATCH = "eos-batch-id"
HEADER_ATTEMPT = "eos-attempt"
HEADER_LEASE = "eos-lease-id"


@dataclass
class Deliveries:
    """What the delivery reports said so far (filled on the thread that polls the producer)."""

    failed: int = 0
    errors: list[str] = field(default_factory=list)  # the first few, for the task's error
    first_offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._want_offsets = True

    def on_delivery(self, err: Any, msg: Any) -> None:
        """The producer's delivery callback: a failure is counted; a success costs a comparison
        once FIRST_OFFSETS_REPORTED topic-partitions have a first offset."""
        if err is not None:
            self.failed += 1
            if len(self.errors) < 5:
                self.errors.append(str(err))
        elif self._want_offsets:
            tp = (msg.topic(), msg.partition())
            if tp not in self.first_offsets:  # delivered in order within a partition: the first is the lowest
                self.first_offsets[tp] = msg.offset()
                self._want_offsets = len(self.first_offsets) < FIRST_OFFSETS_REPORTED

    def reported_first_offsets(self) -> list[list[Any]]:
        return [[t, p, o] for (t, p), o in sorted(self.first_offsets.items())]


@dataclass(frozen=True)
class Columns:
    """Which Kafka-sink columns the rows have (sparkclient/schema.py checked their types)."""

    names: tuple[str, ...]

    def has(self, name: str) -> bool:
        return name in self.names


@dataclass(frozen=True)
class ProduceTarget:
    """Where and how the rows go: the `topic` option (None: the `topic` column), and the
    provenance headers added to every record (None: none)."""

    topic: str | None
    provenance: tuple[tuple[str, bytes], ...] | None = None


@dataclass
class Produced:
    records: int = 0
    bytes: int = 0  # keys and values


def provenance_headers(sink: str, batch_id: int, attempt: int, lease_id: int) -> tuple[tuple[str, bytes], ...]:
    return ((HEADER_SINK, sink.encode()), (HEADER_BATCH, str(batch_id).encode()),
            (HEADER_ATTEMPT, str(attempt).encode()), (HEADER_LEASE, str(lease_id).encode()))


def non_empty(batches: Iterable[Any]) -> tuple[Any | None, Iterator[Any]]:
    """The first record batch with rows (None if there is none) and the rest, unread."""
    it = iter(batches)
    for batch in it:
        if batch.num_rows:
            return batch, it
    return None, it


def produce_batches(producer: Any, batches: Iterable[Any], columns: Columns, target: ProduceTarget,
                    batch_id: int) -> Produced:
    """Produce every row of `batches`; raises ValueError for a row without a topic. Deliveries are
    served as the local queue fills (BufferError) and once per record batch."""
    produced = Produced()
    poll = producer.poll
    for batch in batches:
        if not batch.num_rows:
            continue
        values = _binary_list(batch.column("value"))
        keys = _binary_list(batch.column("key")) if columns.has("key") else repeat(None)
        produced.bytes += _byte_length(batch, columns)
        topic = target.topic
        if topic is None:
            topics = batch.column("topic")
            if topics.null_count:
                raise ValueError(f"batch {batch_id} has a row with a null 'topic' and there is no 'topic' option")
        if topic is not None and not columns.has("partition") and not columns.has("headers") and not target.provenance:
            _produce_kv(producer, topic, values, keys)
        else:
            _produce_general(
                producer,
                repeat(topic) if topic is not None else batch.column("topic").to_pylist(),
                values, keys,
                _partitions(batch.column("partition")) if columns.has("partition") else repeat(-1),
                _headers(batch.column("headers") if columns.has("headers") else None, batch.num_rows,
                         target.provenance))
        produced.records += batch.num_rows
        poll(0)
    return produced


def _produce_kv(producer: Any, topic: str, values: Sequence[bytes | None], keys: Iterable[bytes | None]) -> None:
    produce = producer.produce
    for value, key in zip(values, keys):
        try:
            produce(topic, value, key)
        except BufferError:
            _when_room(producer, topic, value, key)


def _produce_general(producer: Any, topics: Iterable[str], values: Sequence[bytes | None],
                     keys: Iterable[bytes | None], partitions: Iterable[int], headers: Iterable[Any]) -> None:
    # produce(topic, value, key, partition, callback, on_delivery, timestamp, headers): positional,
    # the callback slots None (the producer's own on_delivery), timestamp 0 (now)
    produce = producer.produce
    for topic, value, key, partition, hs in zip(topics, values, keys, partitions, headers):
        try:
            produce(topic, value, key, partition, None, None, 0, hs)
        except BufferError:
            _when_room(producer, topic, value, key, partition, None, None, 0, hs)


def _when_room(producer: Any, *args: Any) -> None:
    """The local queue is full: serve deliveries until the record is taken."""
    while True:
        producer.poll(POLL_WHEN_FULL_S)
        try:
            producer.produce(*args)
            return
        except BufferError:
            continue


def _binary_list(column: Any) -> list[bytes | None]:
    import pyarrow as pa

    t = column.type
    if pa.types.is_string(t):
        column = column.cast(pa.binary())  # a view of the same buffers
    elif pa.types.is_large_string(t):
        column = column.cast(pa.large_binary())
    return column.to_pylist()


def _byte_length(batch: Any, columns: Columns) -> int:
    import pyarrow.compute as pc

    total = 0
    for name in ("key", "value"):
        if columns.has(name):
            total += pc.sum(pc.binary_length(batch.column(name))).as_py() or 0
    return total


def _partitions(column: Any) -> list[int]:
    import pyarrow.compute as pc

    return pc.fill_null(column, -1).to_pylist()  # -1: librdkafka's partitioner decides


def _headers(column: Any | None, rows: int, provenance: tuple[tuple[str, bytes], ...] | None) -> Iterable[Any]:
    """Per row: a list of (key, value) pairs, or None. Arrow's struct values arrive as dicts."""
    if column is None:
        return repeat(list(provenance) if provenance else None, rows)
    extra = list(provenance or ())
    return [[(h["key"], h["value"]) for h in hs] + extra if hs else (extra or None) for hs in column.to_pylist()]
