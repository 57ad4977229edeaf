"""Plain records of the protocol's entities. The store builds them from rows (field names are
column names); the rules and the invariant checker read them. No I/O here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from functools import cache
from typing import Any, Self, get_type_hints

from .states import AttemptState, CheckpointState, LeaseState


class _Record:
    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> Self:
        """Build from a row mapping holding (at least) every field by name; a `state` column
        becomes its enum."""
        values = {name: row[name] for name in _field_names(cls)}
        if "state" in values:
            values["state"] = _state_type(cls)(values["state"])
        return cls(**values)


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]


@cache
def _state_type(cls: type) -> Any:
    return get_type_hints(cls)["state"]


@dataclass(frozen=True)
class Sink(_Record):
    id: int
    name: str
    transactional_id_prefix: str
    bootstrap_servers: str
    topics: list[str]
    transaction_timeout_ms: int
    commit_margin_ms: int
    max_pool_size: int
    generation: int
    lineage_query_id: str | None
    writer_token_version: int
    created_at: datetime
    # set when a decided commit was refused for good (data lost); begin checkpoint is refused
    # until an operator acknowledges, which clears both
    halted_reason: str | None = None
    halted_at: datetime | None = None
    retired_at: datetime | None = None  # retired sinks take no calls; their records stay

    @property
    def halted(self) -> bool:
        return self.halted_at is not None


@dataclass(frozen=True)
class IdPool(_Record):
    """A sink's pool of transactional ids: ordinals 0..size-1 exist (`prefix-<ordinal>`); which
    of them are free follows from the unresolved leases and the quarantine. Ids are handed out
    round-robin from `cursor`, so the least recently leased free id comes first."""

    sink_id: int
    size: int
    cursor: int


@dataclass(frozen=True)
class Checkpoint(_Record):
    id: int
    sink_id: int
    query_id: str
    batch_id: int
    state: CheckpointState
    current_attempt: int
    committed_attempt: int | None
    created_at: datetime
    decided_at: datetime | None
    committed_at: datetime | None
    lost_reason: str | None = None  # why Kafka refused a winner's commit (state LOST)
    lost_at: datetime | None = None
    offsets_digest: str | None = None  # the offsets Spark planned for the batch, bound at first begin
    history_pruned_at: datetime | None = None  # its attempts, leases and events pruned (it stays COMMITTED)


@dataclass(frozen=True)
class Attempt(_Record):
    id: int
    checkpoint_id: int
    number: int
    generation: int
    state: AttemptState
    partitions: int | None
    started_at: datetime
    decided_at: datetime | None
    finished_at: datetime | None
    abort_reason: str | None
    job_ms: int | None = None  # the driver's Spark write job, start to end (reported with the commit)


@dataclass(frozen=True)
class Lease(_Record):
    id: int
    sink_id: int
    checkpoint_id: int
    attempt_id: int
    partition: int
    # the task try that holds it (Spark's task attempt id); None while PRELEASED (no try yet)
    task_attempt_id: int | None
    ordinal: int  # its id in the sink's pool
    transactional_id: str
    state: LeaseState
    taken_at: datetime  # when its id was taken from the pool (begin, for a pre-lease)
    leased_at: datetime  # when a try got it (for a pre-lease no try claimed yet: taken_at)
    deadline_at: datetime  # leased_at + the sink's transaction timeout: the broker aborts by then
    producer_id: int | None
    producer_epoch: int | None
    records: int | None
    bytes: int | None
    write_ms: int | None  # the executor's produce + flush time (reported with the record)
    # JSON text as stored, [[topic, partition, first offset written], ...]: read only when Kafka
    # refuses the commit, so it is not parsed with every lease
    first_offsets: str | None
    resolved_at: datetime | None  # set when it reaches an end state: its id is no longer held

    @property
    def claimed(self) -> bool:
        return self.task_attempt_id is not None


@dataclass(frozen=True)
class Quarantine(_Record):
    """An id that may not be leased before `until`: a try that did not win may still reach the
    broker with it (or the lingering sweep is aborting a transaction on it)."""

    sink_id: int
    ordinal: int
    until: datetime


@dataclass(frozen=True)
class Alert:
    """An event of the audit trail that the invariant checker reads: `data_lost` (a decided commit
    was refused for good) and `lost_data_acknowledged` (an operator cleared the sink's halt)."""

    id: int
    sink_id: int
    checkpoint_id: int | None
    kind: str
    at: datetime


# How many first offsets a pre-commit record keeps. A transaction commits or aborts in all its
# partitions at once, so the outcome check (kafka/outcome.py) needs one conclusive read; a few more
# cover a partition whose leader is down or whose records retention already deleted.
FIRST_OFFSETS_KEPT = 4


@dataclass(frozen=True)
class PrecommitRecord:
    """What a task try reports about its flushed transaction, in its Spark task result; the driver
    sends the winners' records with the commit."""

    task_attempt_id: int  # the try that wrote it: the one that holds the lease
    producer_id: int
    producer_epoch: int
    records: int
    bytes: int
    write_ms: int | None = None  # a figure for operators, not part of the transaction's identity
    # [[topic, partition, offset], ...]: where to look in the log, at most FIRST_OFFSETS_KEPT
    first_offsets: Sequence[Sequence[Any]] | None = None


@dataclass(frozen=True)
class PartitionResult:
    """One entry of a commit request: the winning lease of a partition with its pre-commit
    record, or lease_id None if the partition was empty."""

    partition: int
    lease_id: int | None
    precommit: PrecommitRecord | None = None
