"""Plain records of the protocol's entities. The storage layer builds them from rows (field names
are column names); the rules and the invariant checker read them. No I/O here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from functools import cache
from operator import itemgetter
from typing import Any, Self, get_type_hints

from .states import AttemptState, CheckpointState, LeaseState, TransactionalIdState


class _Record:
    @classmethod
    def from_mapping(cls, row: Any, prefix: str = "") -> Self:
        """Build from a row mapping with the fields' names (each after `prefix`, for one table's
        columns in a joined row); a `state` column becomes its enum. A positional row whose type
        maps column names to positions (`columns`, as the store's driver rows do) is read by
        position, with the positions worked out once per row type."""
        if hasattr(type(row), "columns"):
            names, get = _positional(cls, prefix, type(row))
            values = dict(zip(names, get(tuple(row))))  # a plain tuple: itemgetter at C speed
        else:
            values = {name: row[key] for name, key in _field_keys(cls, prefix)}
        if "state" in values:
            values["state"] = _state_type(cls)(values["state"])
        # every field comes from the row: set them as the generated __init__ would, without its
        # frozen per-field setattr (5x slower; a P=200 batch builds ~800 leases)
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    @classmethod
    def from_fields(cls, **values: Any) -> Self:
        """Build from every field's value (what a statement wrote, when it answers only ids), as
        from_mapping does."""
        if values.keys() != _field_names(cls):
            raise TypeError(f"{cls.__name__} takes exactly its fields: {sorted(_field_names(cls) ^ values.keys())}")
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    @classmethod
    def from_every_field(cls, **values: Any) -> Self:
        """from_fields without its check of the names, for a loop whose one call site names every
        field (a 200-partition commit's body builds 400 records: ~0.2 ms against ~0.45)."""
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    def with_changes(self, **changes: Any) -> Self:
        """A copy with some fields changed (what a statement wrote, when it answers only ids),
        built the way from_mapping builds records."""
        if not changes.keys() <= self.__dict__.keys():
            raise TypeError(f"not fields of {type(self).__name__}: {sorted(changes.keys() - self.__dict__.keys())}")
        record = object.__new__(type(self))
        record.__dict__.update(self.__dict__, **changes)
        return record

    @classmethod
    def all_with_changes(cls, records: Iterable[Self], **changes: Any) -> list[Self]:
        """`with_changes` for each record, the same changes for all, checked once (a 200-partition
        batch's winners marked COMMITTED: ~0.12 ms, against ~0.30 ms one by one)."""
        if not changes.keys() <= _field_names(cls):
            raise TypeError(f"not fields of {cls.__name__}: {sorted(changes.keys() - _field_names(cls))}")
        new, out = object.__new__, []
        for record in records:
            if type(record) is not cls:
                raise TypeError(f"{type(record).__name__} is not a {cls.__name__}")
            copy = new(cls)
            fields_ = copy.__dict__
            fields_.update(record.__dict__)
            fields_.update(changes)
            out.append(copy)
        return out

    def variants(self, names: Sequence[str], values: Iterable[Sequence[Any]]) -> list[Self]:
        """Copies of this record, one per item of `values`, each with the fields `names` set to
        that item's values: a batch's first-try leases, which differ in three fields (200 of them
        in ~0.25 ms, against ~0.47 ms built field by field with from_fields)."""
        if not set(names) <= self.__dict__.keys():
            raise TypeError(f"not fields of {type(self).__name__}: {sorted(set(names) - self.__dict__.keys())}")
        cls, base, new, width = type(self), self.__dict__, object.__new__, len(names)
        out = []
        for item in values:
            if len(item) != width:
                raise ValueError(f"{len(item)} values for the fields {list(names)}")
            record = new(cls)
            fields_ = record.__dict__
            fields_.update(base)
            fields_.update(zip(names, item))
            out.append(record)
        return out


@cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))  # type: ignore[arg-type]


@cache
def _field_keys(cls: type, prefix: str) -> tuple[tuple[str, str], ...]:
    return tuple((f.name, prefix + f.name) for f in fields(cls))  # type: ignore[arg-type]


@cache
def _positional(cls: type, prefix: str, row_type: type) -> tuple[tuple[str, ...], Any]:
    keys = _field_keys(cls, prefix)
    getter = itemgetter(*(row_type.columns[key] for _, key in keys))  # type: ignore[attr-defined]
    return tuple(name for name, _ in keys), getter  # every record has several fields: a tuple


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
    task_attempt_id: int
    transactional_id: str
    state: LeaseState
    leased_at: datetime
    deadline_at: datetime
    producer_id: int | None
    producer_epoch: int | None
    records: int | None
    bytes: int | None
    precommitted_at: datetime | None
    resolved_at: datetime | None
    write_ms: int | None = None  # the executor's produce + flush time (reported with the pre-commit)
    # JSON text as stored, [[topic, partition, first offset written], ...]: read only when Kafka
    # refuses the commit, so it is not parsed with every lease
    first_offsets: str | None = None

    @property
    def first_try(self) -> bool:
        """Pre-leased at begin for the partition's first task try (stage and task attempt 0)."""
        return self.task_attempt_id == FIRST_TRY_TASK_ATTEMPT


@dataclass(frozen=True)
class TransactionalId(_Record):
    id: int
    sink_id: int
    ordinal: int
    transactional_id: str
    state: TransactionalIdState
    lease_id: int | None
    released_at: datetime | None = None
    reusable_at: datetime | None = None  # end of the quarantine of an id freed from an undecided try


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
# cover a partition whose leader is down or whose records retention already deleted. A task that
# wrote every partition of a 200-partition topic would otherwise report 200, and a 200-task
# commit carry 40,000 (~1.2 MB of JSON to parse and store per batch).
FIRST_OFFSETS_KEPT = 4


@dataclass(frozen=True)
class PrecommitRecord(_Record):
    """What a task attempt reports about its flushed transaction (in its Spark task result, which
    the driver forwards with the commit; or, from older clients, with the pre-commit call)."""

    producer_id: int
    producer_epoch: int
    records: int
    bytes: int
    write_ms: int | None = None  # a figure for operators, not part of the transaction's identity
    # [[topic, partition, offset], ...]: where to look in the log, at most FIRST_OFFSETS_KEPT
    first_offsets: Sequence[Sequence[Any]] | None = None

    def identity(self) -> tuple[int, int, int, int]:
        return (self.producer_id, self.producer_epoch, self.records, self.bytes)


@dataclass(frozen=True)
class PartitionResult(_Record):
    """One entry of a commit request: the winning lease of a partition (with its pre-commit record
    when the task returned it to the driver), or None if it was empty."""

    partition: int
    lease_id: int | None
    precommit: PrecommitRecord | None = None


# The task attempt id of a lease taken at begin for a partition's first task try.
FIRST_TRY_TASK_ATTEMPT = -1
