"""The writer's options, spelled like Spark's own Kafka sink plus the coordinator's.

| option | required | meaning |
| --- | --- | --- |
| `kafka.bootstrap.servers` | yes | the Kafka cluster |
| `topic` | unless the DataFrame has a `topic` column | output topic; overrides the column, as in Spark |
| `kafka.<setting>` | no | passed to the confluent-kafka producer (librdkafka spelling) |
| `coordinator.url` | yes | the coordinator's base URL |
| `coordinator.token` | yes | the sink's writer token |
| `coordinator.sink` | yes | the sink's name |
| `checkpointLocation` | yes | the query's checkpoint location (its `metadata` file holds the lineage) |
| `transaction.timeout.ms` | no | expected sink transaction timeout; the first batch fails if the sink's differs |
| `coordinator.request.timeout.ms` | no (30000) | per HTTP request |
| `coordinator.retry.budget.ms` | no (120000) | total retry time of one call (connection errors, 5xx) |
| `provenance.headers` | no (false) | add `eos-sink`, `eos-batch-id`, `eos-attempt`, `eos-lease-id` headers |
| `max.write.tasks` | no (the context's default parallelism) | foreachBatch only: each write task is one Kafka transaction, so a batch with more partitions is coalesced to this many (no shuffle); `0` keeps the batch's partitions. Under Spark Connect the default is `0` (no SparkContext to ask) |
| `offsets.binding` | no (`required`) | `required`: a batch whose `offsets/<batch_id>` entry cannot be read fails; `off`: write without binding batches to their offsets (warned once per run) |

The native sink (sparkclient/sink.py) takes the same options; Spark gives it `checkpointLocation`
(the query's own) and hands the options over with lower-case names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .checkpoint_files import OFFSETS_OFF, OFFSETS_REQUIRED

# Set by the writer from the protocol; a user value would break exactly-once, so it is refused.
RESERVED_PRODUCER_SETTINGS = {
    "transactional.id": "the coordinator leases one per task attempt",
    "enable.idempotence": "always true for transactions",
    "transaction.timeout.ms": "it is the sink's transaction_timeout_ms; set it when registering the sink",
    "bootstrap.servers": "use kafka.bootstrap.servers",
    "on_delivery": "the writer checks every delivery report itself",
    "delivery.report.only.error": "the writer reads every delivery report (the first offsets of its record)",
    "logger": "the writer reads librdkafka's eos log for the producer id (warnings still reach Python's logging)",
}
# Throughput-minded defaults for a producer that writes one partition's batch and then flushes.
# reconnect.backoff.ms: librdkafka spaces new broker connections by half of it (50 ms at its
# default 100), and a fresh producer waits that long once in init_transactions (measured: 54 ms ->
# 15 ms per task at 20); reconnects after a failure still back off exponentially.
PRODUCER_DEFAULTS: dict[str, Any] = {
    "linger.ms": 20,
    "batch.size": 1_000_000,
    "queue.buffering.max.messages": 500_000,
    "reconnect.backoff.ms": 20,
    # librdkafka connects to the transaction coordinator lazily with sparse connections: a fresh
    # producer's init_transactions waited ~500 ms for it on a real broker (9 ms without)
    "enable.sparse.connections": False,
    # Spark's Kafka sink partitions with the Java producer's murmur2 of the key: the same partition
    # for the same key after switching (librdkafka's own default is a CRC32 hash)
    "partitioner": "murmur2_random",
}
_BOOLEAN = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


class WriterOptionError(ValueError):
    """An option is missing or invalid; the message names it and what to set."""


@dataclass(frozen=True)
class WriterOptions:
    bootstrap_servers: str
    coordinator_url: str
    coordinator_token: str
    sink: str
    checkpoint_location: str
    topic: str | None = None
    producer_config: dict[str, Any] = field(default_factory=dict)
    transaction_timeout_ms: int | None = None
    request_timeout_ms: int = 30_000
    retry_budget_ms: int = 120_000
    provenance_headers: bool = False
    offsets_binding: str = OFFSETS_REQUIRED
    max_write_tasks: int | None = None  # None: the Spark context's default parallelism; 0: keep the partitions

    @classmethod
    def parse(cls, options: Mapping[str, Any], *, from_spark: bool = False) -> WriterOptions:
        """`from_spark`: the native sink's options, as Spark hands them over (lower-case names,
        with the query's `checkpointLocation`, which may be absent when a session default is used)."""
        opts = {str(k): v for k, v in options.items()}
        if from_spark:
            opts = {("checkpointLocation" if k.lower() == "checkpointlocation" else k): v for k, v in opts.items()}
            opts.pop("path", None)
            opts.setdefault("checkpointLocation", "")

        def required(name: str) -> str:
            value = opts.pop(name, None)
            if value is None or str(value).strip() == "":
                raise WriterOptionError(f"option {name!r} is required")
            return str(value)

        def integer(name: str, default: int | None, least: int = 1) -> int | None:
            value = opts.pop(name, None)
            if value is None:
                return default
            try:
                number = int(value)
            except (TypeError, ValueError):
                raise WriterOptionError(f"option {name!r} must be an integer, got {value!r}") from None
            if number < least:
                raise WriterOptionError(f"option {name!r} must be {'positive' if least else 'zero or more'}, "
                                        f"got {number}")
            return number

        def boolean(name: str, default: bool) -> bool:
            raw = opts.pop(name, default)
            value = raw if isinstance(raw, bool) else _BOOLEAN.get(str(raw).lower())
            if value is None:
                raise WriterOptionError(f"option {name!r} must be true or false, got {raw!r}")
            return value

        bootstrap = required("kafka.bootstrap.servers")
        url = required("coordinator.url")
        if not url.lower().startswith(("http://", "https://")):
            raise WriterOptionError(f"option 'coordinator.url' must start with http:// or https://, got {url!r}")
        token = required("coordinator.token")
        sink = required("coordinator.sink")
        checkpoint = str(opts.pop("checkpointLocation")) if from_spark else required("checkpointLocation")
        topic = opts.pop("topic", None)
        timeout = integer("transaction.timeout.ms", None)
        request_timeout = integer("coordinator.request.timeout.ms", 30_000)
        budget = integer("coordinator.retry.budget.ms", 120_000)
        provenance = boolean("provenance.headers", False)
        max_tasks = None if from_spark else integer("max.write.tasks", None, least=0)
        binding = str(opts.pop("offsets.binding", OFFSETS_REQUIRED)).lower()
        if binding not in (OFFSETS_REQUIRED, OFFSETS_OFF):
            raise WriterOptionError(f"option 'offsets.binding' must be {OFFSETS_REQUIRED!r} or {OFFSETS_OFF!r}, "
                                    f"got {binding!r}")

        producer = dict(PRODUCER_DEFAULTS)
        for name in list(opts):
            if not name.startswith("kafka."):
                continue
            setting = name[len("kafka."):]
            if setting in RESERVED_PRODUCER_SETTINGS:
                raise WriterOptionError(f"option {name!r} cannot be set: {RESERVED_PRODUCER_SETTINGS[setting]}")
            if setting == "acks" and str(opts[name]).lower() not in ("all", "-1"):
                raise WriterOptionError(f"option {name!r} must be 'all' for transactions, got {opts[name]!r}")
            producer[setting] = opts.pop(name)
        if opts:
            known = "kafka.bootstrap.servers, topic, kafka.*, coordinator.url, coordinator.token, coordinator.sink, " \
                    "checkpointLocation, transaction.timeout.ms, coordinator.request.timeout.ms, " \
                    "coordinator.retry.budget.ms, provenance.headers, offsets.binding, max.write.tasks (foreachBatch)"
            raise WriterOptionError(f"unknown option(s) {sorted(opts)}; known options: {known}")
        return cls(
            bootstrap_servers=bootstrap, coordinator_url=url, coordinator_token=token, sink=sink,
            checkpoint_location=checkpoint, topic=str(topic) if topic else None, producer_config=producer,
            transaction_timeout_ms=timeout, request_timeout_ms=request_timeout or 30_000,
            retry_budget_ms=budget or 120_000, provenance_headers=provenance, offsets_binding=binding,
            max_write_tasks=max_tasks,
        )
