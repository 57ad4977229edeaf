"""Request and response bodies of REST API v1. Requests forbid unknown fields so a misspelt field
is a 422 naming it, not a silently ignored option."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..protocol.model import (
    FIRST_OFFSETS_KEPT,
    Attempt,
    Checkpoint,
    Lease,
    PartitionResult,
    PrecommitRecord,
    Sink,
)
from ..service import AbortOutcome, BatchSummary, BeginResult, CommitResult, LeaseGrant, LeasePage
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
        "the batch's partition count: one transactional id per partition is then taken with the attempt, for "
        "the first task try of each partition to claim (its lease call); omit for no pre-leases"))] = None
    offsets: Annotated[str | None, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9:._-]+$", description=(
        "a digest of the offsets Spark planned for the batch (its offsets/<batch> entry); bound to the "
        "checkpoint at the first begin that names one, and a begin over other offsets is refused (409 "
        "batch_offsets_mismatch). The writer sends none only when its user chose to go without (its option "
        "offsets.binding=off); a replay that cannot be checked is recorded (offsets_unchecked)"))] = None


class LeaseRequest(Request):
    generation: Generation
    partition: Partition
    task_attempt_id: TaskAttemptId


TopicPartitionOffset = tuple[OffsetTopic, Partition, Count]


class PartitionResultBody(Request):
    """One partition of the attempt: its winning lease (null if the partition was empty) with the
    pre-commit record the winning task try returned to the driver."""

    partition: Partition
    lease_id: LeaseId | None = Field(description="the winning lease; null for an empty partition")
    task_attempt_id: TaskAttemptId | None = Field(None, description="the task try that wrote it: the one that holds the lease")
    producer_id: ProducerId | None = None
    producer_epoch: ProducerEpoch | None = None
    records: Annotated[Count, Field(ge=1)] | None = None
    bytes: Count | None = None
    write_ms: Millis | None = None
    first_offsets: Annotated[list[TopicPartitionOffset] | None, Field(max_length=100_000, description=(
        "[topic, partition, offset]: the first offset the transaction wrote in a topic-partition, for "
        f"at most {FIRST_OFFSETS_KEPT} of them (the coordinator keeps the first {FIRST_OFFSETS_KEPT} as sent: "
        "one conclusive read of the log tells whether the transaction committed)"))] = None

    @model_validator(mode="after")
    def _record_whole(self) -> PartitionResultBody:
        record = (self.task_attempt_id, self.producer_id, self.producer_epoch, self.records, self.bytes)
        if self.lease_id is not None and any(x is None for x in record):
            raise ValueError("a winning lease comes with its whole pre-commit record: task_attempt_id, producer_id, "
                             "producer_epoch, records and bytes")
        if self.lease_id is None and any(x is not None for x in record):
            raise ValueError("an empty partition (lease_id null) has no pre-commit record")
        return self

    def result(self) -> PartitionResult:
        if self.lease_id is None:
            return PartitionResult(self.partition, None)
        return PartitionResult(self.partition, self.lease_id, PrecommitRecord(
            task_attempt_id=self.task_attempt_id, producer_id=self.producer_id,  # type: ignore[arg-type]
            producer_epoch=self.producer_epoch, records=self.records, bytes=self.bytes,  # type: ignore[arg-type]
            write_ms=self.write_ms, first_offsets=self.first_offsets and self.first_offsets[:FIRST_OFFSETS_KEPT]))


class CommitRequest(Request):
    generation: Generation
    partitions: Annotated[list[PartitionResultBody], Field(max_length=MAX_COMMIT_PARTITIONS)] = Field(
        description="every partition 0..N-1 of the attempt, once"
    )
    job_ms: Millis | None = Field(None, description="the driver's Spark write job, start to end")

    def results(self) -> list[PartitionResult]:
        return [p.result() for p in self.partitions]


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
    leases: int = 0
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
    task_attempt_id: int | None = Field(description="the task try that holds it; null for a pre-lease no try claimed")
    transactional_id: str
    state: str
    leased_at: datetime
    deadline_at: datetime
    producer_id: int | None
    producer_epoch: int | None
    records: int | None
    bytes: int | None
    resolved_at: datetime | None
    write_ms: int | None = Field(None, description="the task's produce + flush time (reported with its record)")

    @classmethod
    def of(cls, x: Lease, attempt: int | None = None) -> LeaseOut:
        fields = {k: getattr(x, k) for k in cls.model_fields if k not in ("lease_id", "attempt")}
        return cls(lease_id=x.id, attempt=attempt, **fields)


class LeaseRulesOut(BaseModel):
    commit_margin_ms: int = Field(description="a task fails rather than return a transaction this close to its "
                                  "deadline (the commit gate would refuse it)")
    max_lease_init_age_ms: int = Field(description="a task never starts init_transactions on a lease older")
    producer_init_timeout_ms: int = Field(description="the init_transactions timeout tasks use")
    producer_request_timeout_ms: int = Field(description="the producer request timeout tasks use")


class LeaseGranted(LeaseOut, LeaseRulesOut):
    transaction_timeout_ms: int
    age_ms: int = Field(description="the lease's age when answered, by the database's clock: a task adds the time "
                        "since the answer arrived by its own monotonic clock, never another machine's")

    @classmethod
    def of_grant(cls, g: LeaseGrant) -> LeaseGranted:
        return cls(**LeaseOut.of(g.lease, g.attempt).model_dump(), **g.rules.__dict__,
                   transaction_timeout_ms=g.transaction_timeout_ms, age_ms=g.age_ms)


class BeginOut(BaseModel):
    action: str = Field(description="write: write under `attempt`; skip: batch already committed")
    batch_id: int
    state: str
    attempt: int | None
    resumed: bool = Field(description="a decided but unfinished commit was finished by this call")
    aborted: list[str] = Field(description="transactional ids of older attempts aborted")
    abort_pending: list[str] = Field(description="transactional ids of older attempts still to abort")
    pre_leased: int = Field(0, description="partitions whose first try's id was taken with the attempt")
    commit_margin_ms: int | None = Field(None, description="with action write: see the lease's rules")
    max_lease_init_age_ms: int | None = None
    producer_init_timeout_ms: int | None = None
    producer_request_timeout_ms: int | None = None

    @classmethod
    def of(cls, r: BeginResult) -> BeginOut:
        return cls(
            action="write" if r.must_write else "skip",
            batch_id=r.checkpoint.batch_id,
            state=r.checkpoint.state,
            attempt=r.attempt.number if r.attempt and r.must_write else None,
            resumed=r.action == "resume",
            aborted=r.older_aborted,
            abort_pending=r.older_abort_pending,
            pre_leased=r.pre_leased,
            **(r.lease_rules.__dict__ if r.lease_rules else {}),
        )


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
        return cls(
            batch_id=r.checkpoint.batch_id,
            state=r.checkpoint.state,
            attempt=r.attempt.number,
            committed=[CommittedPartition(partition=w.partition, lease_id=w.id, transactional_id=w.transactional_id,
                                          producer_id=w.producer_id, producer_epoch=w.producer_epoch, records=w.records,
                                          bytes=w.bytes)
                       for w in sorted(r.winners, key=lambda w: w.partition)],
            aborted=r.aborts.aborted,
            abort_pending=r.aborts.pending,
            warnings=r.warnings,
        )


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
