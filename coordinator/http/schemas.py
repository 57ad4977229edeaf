"""Request and response bodies of REST API v1. Requests forbid unknown fields so a misspelt field
is a 422 naming it, not a silently ignored option."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from typing_extensions import NotRequired, TypedDict

from ..protocol.model import (
    FIRST_OFFSETS_KEPT,
    Attempt,
    Checkpoint,
    Lease,
    PartitionResult,
    PrecommitRecord,
    Sink,
)
from ..service import AbortOutcome, BatchSummary, BeginResult, CommitResult, LeasePage
from .answers import answer_fields, json_text, millis
from .input import (
    AbortReason,
    BootstrapServers,
    CommitMarginMs,
    Count,
    ErrorBody,  # noqa: F401  (the API's error format lives in http_input; imported from here too)
    ErrorOut,  # noqa: F401
    Generation,
    Id,
    LeaseId,
    Millis,
    OffsetTopic,
    OperatorName,
    Partition,
    PoolSize,
    ProducerEpoch,
    ProducerId,
    Reason,
    SinkName,
    TaskAttemptId,
    Topic,
    TransactionalIdPrefix,
    TransactionTimeoutMs,
)

MAX_COMMIT_PARTITIONS = 100_000  # COORDINATOR_MAX_PARTITIONS' ceiling; the service applies the configured one


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- requests ----------------------------------------------------------------------------------


class SinkRegistration(Request):
    name: SinkName
    transactional_id_prefix: TransactionalIdPrefix
    bootstrap_servers: BootstrapServers
    topics: Annotated[list[Topic], Field(max_length=100)] = []
    transaction_timeout_ms: TransactionTimeoutMs = 60_000
    commit_margin_ms: CommitMarginMs | None = None
    max_pool_size: PoolSize | None = None
    check_broker: bool = Field(
        True,
        description="check the broker before registering (reachability, advertised listeners, transactions, "
        "transaction.max.timeout.ms, prefix not in use); false to register before Kafka exists",
    )


class GenerationRequest(Request):
    query_id: Id = Field(description="Spark's query id, kept in the checkpoint location's metadata file")
    run_id: Id = Field(description="Spark's run id, new at every start of the query")


class LineageReset(Request):
    reason: Reason


class SinkRetirement(Request):
    reason: Reason = Field(description="why the sink is retired (kept in the event trail)")


class LostDataAcknowledgement(Request):
    reason: Reason = Field(description="what was done about the lost data (re-delivered, accepted, ...)")
    operator: OperatorName | None = Field(None, description="who acknowledges (kept in the event trail)")


class HistoryPrune(Request):
    older_than_s: int = Field(ge=0, le=100 * 365 * 86_400, description=(
        "prune the history of batches committed more than this many seconds ago (at least an hour: "
        "younger history is refused, 422 invalid_prune)"))
    sink: SinkName | None = Field(None, description="only this sink's batches (a retired sink's too); every sink's by default")
    limit: int = Field(500, ge=1, le=5_000, description="batches per call, in one transaction: call again while `more`")
    dry_run: bool = Field(False, description="count the batches a prune would take now; delete nothing")


class BeginCheckpointRequest(Request):
    generation: Generation
    partitions: Annotated[int | None, Field(ge=0, le=100_000, description=(
        "the batch's partition count: a write answer then carries a pre-leased transactional id for "
        "each partition's first task try (stage attempt 0, task attempt 0); omit for no pre-leases"))] = None
    offsets: Annotated[str | None, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9:._-]+$", description=(
        "a digest of the offsets Spark planned for the batch (its offsets/<batch> entry); bound to the "
        "checkpoint at the first begin that names one, and a begin over other offsets is refused (409 "
        "batch_offsets_mismatch). Optional for older clients"))] = None


class LeaseRequest(Request):
    generation: Generation
    partition: Partition
    task_attempt_id: TaskAttemptId


class PrecommitBody(Request):
    generation: Generation
    producer_id: ProducerId
    producer_epoch: ProducerEpoch
    records: Annotated[Count, Field(ge=1, description="an empty partition takes no lease and never pre-commits")]
    bytes: Count
    write_ms: Millis | None = Field(None, description="the task's produce + flush time, for throughput figures")


TopicPartitionOffset = tuple[OffsetTopic, Partition, Count]


# A TypedDict, not a model: validated as a dict without a model's instance (and its Python
# validator) per partition, then turned into records by CommitRequest.results() (a 200-partition
# body's parse and conversion in 0.85x the time).
class PartitionResultBody(TypedDict):
    """One partition of the attempt: its winning lease (null if the partition was empty) and, when
    the task returned it to the driver, the winner's pre-commit record (producer_id,
    producer_epoch, records and bytes come together)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    partition: Partition
    lease_id: Annotated[LeaseId | None, Field(description="the winning lease; null for an empty partition")]
    # the winner's pre-commit record from its Spark task result (all four, or none if the lease was
    # pre-committed with the pre-commit call)
    producer_id: NotRequired[ProducerId | None]
    producer_epoch: NotRequired[ProducerEpoch | None]
    records: NotRequired[Annotated[Count, Field(ge=1)] | None]
    bytes: NotRequired[Count | None]
    write_ms: NotRequired[Millis | None]
    # the task try that wrote the record (Spark's task attempt id, as it claimed the lease)
    task_attempt_id: NotRequired[TaskAttemptId | None]
    first_offsets: NotRequired[Annotated[list[TopicPartitionOffset] | None, Field(max_length=100_000, description=(
        "[topic, partition, offset]: the first offset the transaction wrote in a topic-partition, for "
        f"at most {FIRST_OFFSETS_KEPT} of them (the coordinator keeps the first {FIRST_OFFSETS_KEPT} as sent: "
        "one conclusive read of the log tells whether the transaction committed)"))]]


_RECORD_FIELDS = ("producer_id", "producer_epoch", "records", "bytes")


class CommitRequest(Request):
    generation: Generation
    partitions: Annotated[list[PartitionResultBody], Field(max_length=MAX_COMMIT_PARTITIONS)] = Field(
        description="every partition 0..N-1 of the attempt, once"
    )
    job_ms: Millis | None = Field(None, description="the driver's Spark write job, start to end")

    @field_validator("partitions")
    @classmethod
    def _records_whole(cls, partitions: list[PartitionResultBody]) -> list[PartitionResultBody]:
        """One pass over the partitions (a validator per partition costs a Python call each)."""
        for i, p in enumerate(partitions):
            given = sum(p.get(name) is not None for name in _RECORD_FIELDS)
            if given and given < 4:
                raise ValueError(f"partitions[{i}]: producer_id, producer_epoch, records and bytes come together "
                                 "(the pre-commit record)")
            if given and p["lease_id"] is None:
                raise ValueError(f"partitions[{i}]: a pre-commit record needs the lease_id it belongs to")
        return partitions

    def results(self) -> list[PartitionResult]:
        result, record = PartitionResult.from_every_field, PrecommitRecord.from_every_field
        # (topic, partition, offset) tuples as validated: stored as JSON, where a tuple is an array;
        # an older writer's longer list is cut to the first FIRST_OFFSETS_KEPT
        return [
            result(partition=p["partition"], lease_id=p["lease_id"], precommit=None if p.get("producer_id") is None
                   else record(producer_id=p["producer_id"], producer_epoch=p["producer_epoch"], records=p["records"],
                               bytes=p["bytes"], write_ms=p.get("write_ms"),
                               first_offsets=(first := p.get("first_offsets")) and first[:FIRST_OFFSETS_KEPT]))
            for p in self.partitions
        ]


class AbortRequest(Request):
    generation: Generation | None = Field(None, description="required for writer tokens; operators may omit it")
    reason: AbortReason = "aborted_by_driver"


# --- responses ---------------------------------------------------------------------------------


class SinkOut(BaseModel):
    name: str
    transactional_id_prefix: str
    bootstrap_servers: str
    topics: list[str]
    transaction_timeout_ms: int
    commit_margin_ms: int
    max_pool_size: int
    generation: int
    lineage_query_id: str | None
    created_at: datetime
    halted: bool = Field(description="lost data: begin checkpoint is refused until an operator acknowledges")
    halted_reason: str | None
    halted_at: datetime | None
    retired_at: datetime | None = Field(None, description="set once retired: the sink takes no more calls")

    @classmethod
    def of(cls, s: Sink) -> SinkOut:
        return cls(**{k: getattr(s, k) for k in cls.model_fields})


class HistoryPruned(BaseModel):
    cutoff: datetime = Field(description="batches committed before this were prunable")
    pruned: int = Field(description="batches whose attempts, leases and events this call deleted")
    more: bool = Field(description="prunable batches are left: call again (a dry run: whether there are any)")
    candidates: int | None = Field(None, description="a dry run: the batches a prune would take now")
    attempts: int = 0
    lease_rows: int = 0
    events: int = 0
    by_sink: dict[str, int] = Field(description="batches pruned (a dry run: prunable) by sink")


class LostDataAcknowledged(BaseModel):
    sink: SinkOut
    acknowledged: bool = Field(description="false if the sink was not halted (a retried acknowledgement)")
    lost_batches: list[int] = Field(description="batch ids of the LOST checkpoints this acknowledgement covers")


class SinkRegistered(BaseModel):
    sink: SinkOut
    writer_token: str = Field(description="bearer token for this sink's protocol calls; keep it secret")
    warnings: list[str] = Field([], description="e.g. that the broker was not checked (check_broker=false)")


class GenerationOut(BaseModel):
    generation: int
    aborted: list[str]
    abort_pending: list[str]


class AttemptOut(BaseModel):
    number: int
    generation: int
    state: str
    partitions: int | None
    started_at: datetime
    decided_at: datetime | None
    finished_at: datetime | None
    abort_reason: str | None
    job_ms: int | None = Field(None, description="the driver's Spark write job (reported with the commit)")

    @classmethod
    def of(cls, a: Attempt) -> AttemptOut:
        return cls(**{k: getattr(a, k) for k in cls.model_fields})


class CheckpointOut(BaseModel):
    batch_id: int
    query_id: str
    state: str
    current_attempt: int
    committed_attempt: int | None
    created_at: datetime
    decided_at: datetime | None
    committed_at: datetime | None
    lost_reason: str | None = None
    lost_at: datetime | None = None
    history_pruned_at: datetime | None = Field(None, description="its attempts, leases and events were pruned then")

    @classmethod
    def of(cls, c: Checkpoint) -> CheckpointOut:
        return cls(**{k: getattr(c, k) for k in cls.model_fields})


class LeaseOut(BaseModel):
    lease_id: int
    attempt: int | None = None
    partition: int
    task_attempt_id: int
    transactional_id: str
    state: str
    leased_at: datetime
    deadline_at: datetime
    producer_id: int | None
    producer_epoch: int | None
    records: int | None
    bytes: int | None
    precommitted_at: datetime | None
    resolved_at: datetime | None
    write_ms: int | None = Field(None, description="the task's produce + flush time (reported with the pre-commit)")

    @classmethod
    def of(cls, x: Lease, attempt: int | None = None) -> LeaseOut:
        fields = {k: getattr(x, k) for k in cls.model_fields if k not in ("lease_id", "attempt")}
        return cls(lease_id=x.id, attempt=attempt, **fields)


class LeaseGranted(LeaseOut):
    transaction_timeout_ms: int
    age_ms: int = Field(0, description="the lease's age when answered, by the database's clock")
    max_lease_init_age_ms: int | None = Field(None, description="a task never starts init_transactions on a lease older")


class PreLeaseOut(BaseModel):
    lease_id: int
    partition: int
    transactional_id: str
    leased_at: datetime
    deadline_at: datetime
    transaction_timeout_ms: int
    age_ms: int = Field(description="the lease's age when answered, by the database's clock")


class BeginOut(BaseModel):
    action: str = Field(description="write: write under `attempt`; skip: batch already committed")
    batch_id: int
    state: str
    attempt: int | None
    resumed: bool = Field(description="a decided but unfinished commit was finished by this call")
    aborted: list[str] = Field(description="transactional ids of older attempts aborted")
    abort_pending: list[str] = Field(description="transactional ids of older attempts still to abort")
    pre_leases: list[PreLeaseOut] = Field(
        default_factory=list, description="with action write and a partition count: each partition's first-try lease"
    )
    commit_margin_ms: int | None = Field(None, description="a task fails rather than return a transaction this "
                                         "close to its deadline (the commit gate would refuse it)")
    max_lease_init_age_ms: int | None = Field(None, description="a task never starts init_transactions on a lease older")
    producer_init_timeout_ms: int | None = Field(None, description="the init_transactions timeout tasks use")
    producer_request_timeout_ms: int | None = Field(None, description="the producer request timeout tasks use")

    @classmethod
    def of(cls, r: BeginResult) -> BeginOut:
        return cls.model_validate(cls.fields_of(r))

    @classmethod
    def fields_of(cls, r: BeginResult) -> dict[str, Any]:
        """The answer's fields as plain values (see `answer_fields`)."""
        at = r.answered_at
        # a batch's first tries share their times: each pair's figures and JSON text made once
        # (the text as pydantic's core encodes a datetime field: 200 of them cost ~0.15 ms)
        times: dict[tuple[datetime, datetime], tuple[str, str, int, int]] = {}

        def times_of(x: Lease) -> tuple[str, str, int, int]:
            key = (x.leased_at, x.deadline_at)
            if key not in times:
                times[key] = (json_text(x.leased_at), json_text(x.deadline_at), millis(x.deadline_at - x.leased_at),
                              max(0, millis(at - x.leased_at)) if at is not None else 0)
            return times[key]

        return answer_fields(cls, dict(
            action="write" if r.must_write else "skip",
            batch_id=r.checkpoint.batch_id,
            state=r.checkpoint.state,
            attempt=r.attempt.number if r.attempt else None,
            resumed=r.action == "resume",
            aborted=r.older_aborted,
            abort_pending=r.older_abort_pending,
            pre_leases=[
                dict(
                    lease_id=x.id, partition=x.partition, transactional_id=x.transactional_id, leased_at=leased_at,
                    deadline_at=deadline_at, transaction_timeout_ms=timeout, age_ms=age,
                )
                for x in r.pre_leases
                for leased_at, deadline_at, timeout, age in (times_of(x),)
            ],
            **(r.lease_rules or {}),
        ))


class CommittedPartition(BaseModel):
    partition: int
    lease_id: int
    transactional_id: str
    producer_id: int | None
    producer_epoch: int | None
    records: int | None
    bytes: int | None


class CommitOut(BaseModel):
    batch_id: int
    state: str
    attempt: int
    committed: list[CommittedPartition]
    aborted: list[str]
    abort_pending: list[str]
    warnings: list[str]

    @classmethod
    def of(cls, r: CommitResult) -> CommitOut:
        return cls.model_validate(cls.fields_of(r))

    @classmethod
    def fields_of(cls, r: CommitResult) -> dict[str, Any]:
        """The answer's fields as plain values (see `answer_fields`)."""
        return answer_fields(cls, dict(
            batch_id=r.checkpoint.batch_id,
            state=r.checkpoint.state,
            attempt=r.attempt.number,
            committed=[
                dict(
                    partition=w.partition,
                    lease_id=w.id,
                    transactional_id=w.transactional_id,
                    producer_id=w.producer_id,
                    producer_epoch=w.producer_epoch,
                    records=w.records,
                    bytes=w.bytes,
                )
                for w in sorted(r.winners, key=lambda w: w.partition)
            ],
            aborted=r.aborts.aborted,
            abort_pending=r.aborts.pending,
            warnings=r.warnings,
        ))


class AbortOut(BaseModel):
    attempt: AttemptOut
    aborted: list[str]
    abort_pending: list[str]

    @classmethod
    def of(cls, attempt: Attempt, outcome: AbortOutcome) -> AbortOut:
        return cls(attempt=AttemptOut.of(attempt), aborted=outcome.aborted, abort_pending=outcome.pending)


class CheckpointDetailOut(BaseModel):
    checkpoint: CheckpointOut
    attempts: list[AttemptOut]
    records: int | None  # what the decided attempt's winners wrote; None: not decided, or history pruned
    bytes: int | None
    leases: list[LeaseOut]  # one page, by id
    lease_counts: dict[str, int]  # every lease of the checkpoint, by state
    next_after_lease_id: int | None  # the next page's after_lease_id; None: no more

    @classmethod
    def of(cls, batch: BatchSummary, page: LeasePage) -> CheckpointDetailOut:
        number = {a.id: a.number for a in batch.attempts}
        return cls(
            checkpoint=CheckpointOut.of(batch.checkpoint),
            attempts=[AttemptOut.of(a) for a in batch.attempts],
            records=batch.records,
            bytes=batch.bytes,
            leases=[LeaseOut.of(x, number.get(x.attempt_id)) for x in page.leases],
            lease_counts={state.value: n for state, n in sorted(page.by_state.items())},
            next_after_lease_id=page.leases[-1].id if page.more else None,
        )


class EventOut(BaseModel):
    id: int
    at: datetime
    kind: str
    actor: str
    batch_id: int | None
    detail: dict[str, Any]
