"""The values the coordinator's operations take and answer with (the API's schemas, the CLI,
the dashboard and the tests read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from ..kafka.control_plane import OpenTransaction
from ..protocol.configuration import CommitReach
from ..protocol.model import Attempt, Checkpoint, Lease, Sink
from ..protocol.rules import BeginAction
from ..store.reads import BatchSummary, LeasePage

__all__ = [
    "AbortOutcome", "BatchSummary", "BeginResult", "CheckpointDetail", "CommitResult", "FinishOutcome", "LeaseGrant",
    "LeasePage", "LeaseRules", "Limits", "OpenTransactions", "PoolUsage", "SinkOverview", "SinkSpec", "SweepOutcome",
]


@dataclass(frozen=True)
class Limits:
    max_partitions: int = 4096
    broker_max_transaction_timeout_ms: int = 900_000  # Kafka's default transaction.max.timeout.ms
    restart_budget_ms: int = 20_000
    # Kafka commits and aborts of one batch: at most this many calls at once
    kafka_parallelism: int = 16
    # No quick reuse (DESIGN §3 Revisions): an executor starts init_transactions only on a lease
    # younger than lease_max_init_age_ms, gives init_transactions producer_init_timeout_ms and its
    # requests producer_request_timeout_ms (all three sent to the driver with begin), so an id freed
    # from a try that did not win is reused only after a quarantine longer than their sum.
    lease_max_init_age_ms: int = 30_000
    producer_init_timeout_ms: int = 60_000
    producer_request_timeout_ms: int = 60_000
    transactional_id_quarantine_ms: int = 180_000
    # history younger than this is never pruned (service/history.py): a driver may still retry the
    # commit call of a batch it decided, and that answer is read from the batch's record
    history_min_retention_ms: int = 3_600_000
    # the settings' bound on how late a decided commit may reach Kafka: sinks whose commit margin
    # is not above it are refused, and finishers retry a commit only inside its window; None
    # (library use, tests) skips the check and retries for the control plane's budget
    commit_reach: CommitReach | None = None

    @property
    def quarantine(self) -> timedelta:
        return timedelta(milliseconds=self.transactional_id_quarantine_ms)


@dataclass(frozen=True)
class SinkSpec:
    name: str
    transactional_id_prefix: str
    bootstrap_servers: str
    topics: list[str]
    transaction_timeout_ms: int = 60_000
    commit_margin_ms: int | None = None
    max_pool_size: int | None = None


@dataclass(frozen=True)
class AbortOutcome:
    aborted: list[str] = field(default_factory=list)  # transactional ids aborted on Kafka
    pending: list[str] = field(default_factory=list)  # still to abort (Kafka unreachable or unconfigured)


@dataclass(frozen=True)
class LeaseRules:
    """What every task try must respect, sent with begin and with each lease."""

    commit_margin_ms: int
    max_lease_init_age_ms: int
    producer_init_timeout_ms: int
    producer_request_timeout_ms: int


@dataclass(frozen=True)
class BeginResult:
    action: BeginAction
    checkpoint: Checkpoint
    attempt: Attempt | None
    older_aborted: list[str]
    older_abort_pending: list[str]
    pre_leased: int = 0  # partitions whose first try's id was taken with the attempt
    lease_rules: LeaseRules | None = None  # with a write answer

    @property
    def must_write(self) -> bool:
        return self.action in (BeginAction.NEW_ATTEMPT, BeginAction.CONTINUE)


@dataclass(frozen=True)
class LeaseGrant:
    """A task try's lease, with its age by the database's clock when answered."""

    lease: Lease
    attempt: int
    age_ms: int
    transaction_timeout_ms: int
    rules: LeaseRules


@dataclass(frozen=True)
class CommitResult:
    checkpoint: Checkpoint
    attempt: Attempt
    winners: list[Lease]
    aborts: AbortOutcome
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FinishOutcome:
    """What finishing a sink's decided commits did (recovery loop)."""

    committed: list[int] = field(default_factory=list)  # batch ids now COMMITTED
    lost: list[int] = field(default_factory=list)  # batch ids LOST (Kafka refused a winner for good)
    failed: dict[int, str] = field(default_factory=dict)  # batch id -> why it is still COMMITTING


@dataclass(frozen=True)
class SweepOutcome:
    """The lingering-transaction sweep of one sink."""

    found: list[OpenTransaction] = field(default_factory=list)  # open, and unexplained by the database
    aborted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # leased since the broker was read: explained
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointDetail:
    checkpoint: Checkpoint
    attempts: list[Attempt]
    leases: list[Lease]


@dataclass(frozen=True)
class SinkOverview:
    """One sink as the dashboard's overview shows it."""

    sink: Sink
    recent: list[tuple[Checkpoint, list[Attempt]]]  # its newest checkpoints, newest first
    last_committed: Checkpoint | None
    open_transactions: int  # leases whose transactional ids may hold an open transaction
    near_timeout_candidates: list[Lease]  # of them, those recovery_rules.near_timeout looks at


@dataclass(frozen=True)
class OpenTransactions:
    """A sink's possibly open transactions in brief."""

    count: int
    oldest: list[Lease]  # the first few, by lease time: the nearest their timeout
    near_timeout_candidates: list[Lease]  # all of them that recovery_rules.near_timeout looks at


@dataclass(frozen=True)
class PoolUsage:
    size: int  # transactional ids created so far (the pool grows on demand)
    leased: int  # of them held by an unresolved lease
    max_size: int  # the sink's max_pool_size
