"""The values the coordinator's operations take and answer with (the API's schemas, the CLI,
the dashboard and the tests read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from ..kafka.control_plane import OpenTransaction
from ..protocol.model import Attempt, Checkpoint, Lease, Sink
from ..protocol import rules
from ..protocol.rules import BeginAction
from ..protocol.states import LeaseState


@dataclass(frozen=True)
class Limits:
    max_partitions: int = 4096
    broker_max_transaction_timeout_ms: int = 900_000  # Kafka's default transaction.max.timeout.ms
    restart_budget_ms: int = 20_000
    # Kafka commits/aborts of one checkpoint run this many at a time; 1 runs them in order (the
    # simulation needs that, so a seed replays the same schedule).
    kafka_parallelism: int = 16
    # No quick reuse (DESIGN §3 Revisions): an executor starts init_transactions only on a lease
    # younger than lease_max_init_age_ms, gives init_transactions producer_init_timeout_ms and its
    # requests producer_request_timeout_ms (all three sent to the driver with begin), so an id freed
    # from an undecided try is reused only after a quarantine longer than their sum.
    lease_max_init_age_ms: int = 30_000
    producer_init_timeout_ms: int = 60_000
    producer_request_timeout_ms: int = 60_000
    transactional_id_quarantine_ms: int = 180_000
    # history younger than this is never pruned (service/history.py): a driver may still retry the
    # commit call of a batch it decided, and that answer is read from the batch's record
    history_min_retention_ms: int = 3_600_000

    @property
    def quarantine(self) -> timedelta:
        return timedelta(milliseconds=self.transactional_id_quarantine_ms)

    # the settings' bound on how late a decided commit may reach Kafka (rules.CommitReach): sinks
    # whose commit margin is not above it are refused; None (library use, tests) skips the check
    commit_reach: rules.CommitReach | None = None


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
class BeginResult:
    action: BeginAction
    checkpoint: Checkpoint
    attempt: Attempt | None
    older_aborted: list[str]
    older_abort_pending: list[str]
    # with a write answer and a partition count: the lease of each partition's first task try
    pre_leases: list[Lease] = field(default_factory=list)
    answered_at: datetime | None = None  # the database's time when the pre-leases were read (their age)
    # what tasks must respect (commit_margin_ms, max_lease_init_age_ms, producer_init_timeout_ms,
    # producer_request_timeout_ms), with a write answer
    lease_rules: dict[str, int] | None = None

    @property
    def must_write(self) -> bool:
        return self.action in (BeginAction.NEW_ATTEMPT, BeginAction.CONTINUE)


@dataclass(frozen=True)
class CommitResult:
    checkpoint: Checkpoint
    attempt: Attempt
    winners: list[Lease]
    aborts: AbortOutcome
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Decision:
    """A decided commit and the winners still to commit on Kafka."""

    sink: Sink
    checkpoint: Checkpoint
    attempt: Attempt
    winners: list[Lease]
    # when every winner is a first try on the attempt's row: the row's other first tries, as the
    # decision ended them (ABORTED), for the mark that needs no read of the row
    unused_first_tries: list[Lease] | None = None


@dataclass(frozen=True)
class FinishOutcome:
    """What finishing the sink's decided commits did (recovery loop)."""

    committed: list[int] = field(default_factory=list)  # batch ids now COMMITTED
    lost: list[int] = field(default_factory=list)  # batch ids LOST (Kafka refused a winner for good)
    failed: dict[int, str] = field(default_factory=dict)  # batch id -> why it is still COMMITTING


@dataclass(frozen=True)
class SweepOutcome:
    """The lingering-transaction sweep of one sink."""

    found: list[OpenTransaction] = field(default_factory=list)  # open, and unexplained by the database
    aborted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # being leased right now (row locked): explained
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointDetail:
    checkpoint: Checkpoint
    attempts: list[Attempt]
    leases: list[Lease]


@dataclass(frozen=True)
class BatchSummary:
    """A checkpoint, its attempts and what its decided attempt's winners wrote, summed by Postgres:
    a batch as the dashboard lists it, without loading its leases (a batch may have thousands)."""

    checkpoint: Checkpoint
    attempts: list[Attempt]
    records: int | None  # None until a commit is decided
    bytes: int | None

    @property
    def decided_attempt(self) -> Attempt | None:
        return next((a for a in self.attempts if a.number == self.checkpoint.committed_attempt), None)


@dataclass(frozen=True)
class LeasePage:
    """Some of a checkpoint's leases, by id, and how many it has in each state."""

    leases: list[Lease]
    by_state: dict[LeaseState, int]
    more: bool  # leases of the state asked for follow the last one listed


@dataclass(frozen=True)
class SinkOverview:
    """One sink as the dashboard's overview shows it (Reads.sink_overviews)."""

    sink: Sink
    recent: list[tuple[Checkpoint, list[Attempt]]]  # its newest checkpoints, newest first
    last_committed: Checkpoint | None
    open_transactions: int  # leases whose transactional ids may hold an open transaction
    near_timeout_candidates: list[Lease]  # of them, those recovery_rules.near_timeout looks at


@dataclass(frozen=True)
class OpenTransactions:
    """A sink's possibly open transactions in brief (Reads.open_transactions_in_brief)."""

    count: int
    oldest: list[Lease]  # the first few, by lease time: the nearest their timeout
    near_timeout_candidates: list[Lease]  # all of them that recovery_rules.near_timeout looks at


@dataclass(frozen=True)
class PoolUsage:
    size: int  # transactional ids created so far (the pool grows on demand)
    leased: int  # of them held by an unresolved lease
    max_size: int  # the sink's max_pool_size
