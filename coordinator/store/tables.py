"""The schema, as SQLAlchemy Core tables. Alembic's migrations create exactly this (a test checks
that the migrated database and this metadata agree)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
    }
)

TS = DateTime(timezone=True)


def _states(*names: str) -> CheckConstraint:
    return CheckConstraint("state IN (" + ", ".join(f"'{n}'" for n in names) + ")", name="state")

sinks = Table(
    "sinks",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("name", String(100), nullable=False, unique=True),
    Column("transactional_id_prefix", String(200), nullable=False, unique=True),
    Column("bootstrap_servers", String(2000), nullable=False),
    Column("topics", JSONB, nullable=False),
    Column("transaction_timeout_ms", Integer, nullable=False),
    Column("commit_margin_ms", Integer, nullable=False),
    Column("max_pool_size", Integer, nullable=False),
    Column("generation", Integer, nullable=False, server_default=text("0")),
    Column("lineage_query_id", String(100), nullable=True),
    Column("writer_token_version", Integer, nullable=False, server_default=text("1")),
    Column("created_at", TS, nullable=False),
    # lost data halts the sink (begin checkpoint refused) until an operator acknowledges
    Column("halted_reason", String(2000), nullable=True),
    Column("halted_at", TS, nullable=True),
    # retired by an operator once nothing of it could be open: kept for the audit trail, takes no calls
    Column("retired_at", TS, nullable=True),
)

generations = Table(
    "generations",
    metadata,
    Column("sink_id", BigInteger, ForeignKey("sinks.id"), primary_key=True),
    Column("generation", Integer, primary_key=True),
    Column("query_id", String(100), nullable=False),
    Column("run_id", String(100), nullable=False),
    Column("started_at", TS, nullable=False),
    UniqueConstraint("sink_id", "run_id"),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("sink_id", BigInteger, ForeignKey("sinks.id"), nullable=False),
    Column("query_id", String(100), nullable=False),
    Column("batch_id", BigInteger, nullable=False),
    Column("state", String(16), nullable=False),
    Column("current_attempt", Integer, nullable=False, server_default=text("0")),
    Column("committed_attempt", Integer, nullable=True),
    Column("created_at", TS, nullable=False),
    Column("decided_at", TS, nullable=True),
    Column("committed_at", TS, nullable=True),
    Column("lost_reason", String(2000), nullable=True),
    Column("lost_at", TS, nullable=True),
    # the digest of the offsets Spark planned for the batch, bound at the first begin that names
    # them: a begin over other offsets (a checkpoint restored from a backup) is refused
    Column("offsets_digest", String(128), nullable=True),
    # set when an old COMMITTED batch's attempts, leases and events were pruned (service/history.py);
    # the row stays, to answer a replay of the batch id
    Column("history_pruned_at", TS, nullable=True),
    UniqueConstraint("sink_id", "query_id", "batch_id"),
    _states("OPEN", "COMMITTING", "COMMITTED", "LOST"),
    CheckConstraint("history_pruned_at IS NULL OR state = 'COMMITTED'", name="pruned_committed"),
    # the recovery loop looks for COMMITTING checkpoints; listing by state per sink
    Index(None, "sink_id", "state", "batch_id"),
    # pruning finds the oldest committed batches not pruned yet without reading the pruned ones
    Index("ix_checkpoints_prunable", "committed_at",
          postgresql_where=text("state = 'COMMITTED' AND history_pruned_at IS NULL")),
)

attempts = Table(
    "attempts",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("checkpoint_id", BigInteger, ForeignKey("checkpoints.id"), nullable=False),
    Column("sink_id", BigInteger, ForeignKey("sinks.id"), nullable=False),
    Column("number", Integer, nullable=False),
    Column("generation", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("partitions", Integer, nullable=True),
    Column("started_at", TS, nullable=False),
    Column("decided_at", TS, nullable=True),
    Column("finished_at", TS, nullable=True),
    Column("abort_reason", String(200), nullable=True),
    Column("job_ms", BigInteger, nullable=True),
    # The first tries of the common path, kept on this row instead of as lease rows (migration
    # 0012): their transactional ids (the i-th for partition i), their deadline, and the decision's
    # records by partition (JSON text as the coordinator encoded it, stored uncompressed: migrations
    # 0015, 0018). The view first_try_leases shows them as leases; any other change to one first
    # copies them into lease_rows (repo.materialize_first_tries) and clears these columns.
    Column("first_tids", ARRAY(String(255)), nullable=True),
    Column("first_deadline_at", TS, nullable=True),
    Column("first_records", Text, nullable=True),
    UniqueConstraint("checkpoint_id", "number"),
    # the key of leases' one foreign key (migration 0010)
    UniqueConstraint("id", "checkpoint_id", "sink_id"),
    _states("OPEN", "COMMITTING", "COMMITTED", "ABORTED", "LOST"),
    # first tries stay on the row only on the common path: an attempt that ends otherwise was
    # materialised first
    CheckConstraint("first_tids IS NULL OR state IN ('OPEN', 'COMMITTING', 'COMMITTED')", name="first_tries"),
    # "every open attempt of this sink" at begin checkpoint and generation start: queries add
    # `finished_at IS NULL` (OPEN or COMMITTING) to `state = 'OPEN'`; no index covers `state`, so
    # the decision (OPEN -> COMMITTING) is a HOT update (migration 0007; fillfactor 80 there too)
    Index("ix_attempts_open", "sink_id", postgresql_where=text("finished_at IS NULL")),
    # a generation start's answer: the attempts it fenced (migration 0011)
    Index("ix_attempts_aborted", "sink_id", postgresql_where=text("abort_reason IS NOT NULL")),
)

# What an Attempt record holds: every column but the first tries', which are read through the
# views (a 200-partition batch's records are ~30 KB of JSON to parse for nothing).
attempt_columns = tuple(c for c in attempts.c if not c.name.startswith("first_"))

transactional_ids = Table(
    "transactional_ids",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("sink_id", BigInteger, ForeignKey("sinks.id"), nullable=False),
    Column("ordinal", Integer, nullable=False),
    Column("transactional_id", String(255), nullable=False, unique=True),
    Column("state", String(16), nullable=False),
    Column("lease_id", BigInteger, nullable=True),
    # when its last lease was resolved (least recently used first), and, for an id freed from an
    # undecided try, the end of its quarantine: no lease before then (a zombie try may still reach
    # the broker with InitProducerId until then)
    Column("released_at", TS, nullable=True),
    Column("reusable_at", TS, nullable=True),
    # also the pool query's path: it reads the sink's ids and sorts the free ones, least recently
    # released first. No index covers `state`, `lease_id` or `released_at`, so leasing and freeing an
    # id are both HOT updates (migrations 0007, 0013).
    UniqueConstraint("sink_id", "ordinal"),
    _states("FREE", "LEASED"),
)

# Leases written as rows: a retry's or a speculative copy's, and a batch's first tries once anything
# but the common path happened to them. Read through the views below, which add the first tries
# still on their attempt rows; write here (after repo.materialize_first_tries).
lease_rows = Table(
    "lease_rows",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("sink_id", BigInteger, nullable=False),
    Column("checkpoint_id", BigInteger, nullable=False),
    Column("attempt_id", BigInteger, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("task_attempt_id", BigInteger, nullable=False),
    Column("transactional_id", String(255), nullable=False),
    Column("state", String(16), nullable=False),
    Column("leased_at", TS, nullable=False),
    Column("deadline_at", TS, nullable=False),
    Column("producer_id", BigInteger, nullable=True),
    Column("producer_epoch", Integer, nullable=True),
    Column("records", BigInteger, nullable=True),
    Column("bytes", BigInteger, nullable=True),
    Column("precommitted_at", TS, nullable=True),
    Column("resolved_at", TS, nullable=True),
    Column("write_ms", BigInteger, nullable=True),
    # JSON text [[topic, partition, offset], ...]: the first offset the transaction wrote per
    # topic-partition; parsed only when Kafka refuses the commit (migration 0009)
    Column("first_offsets", Text, nullable=True),
    UniqueConstraint("attempt_id", "partition", "task_attempt_id"),
    # its attempt, and that attempt's checkpoint and sink (copied here): one check per inserted
    # lease instead of one per column (migration 0010)
    ForeignKeyConstraint(["attempt_id", "checkpoint_id", "sink_id"],
                         ["attempts.id", "attempts.checkpoint_id", "attempts.sink_id"]),
    _states("LEASED", "PRECOMMITTED", "COMMITTING", "COMMITTED", "ABORTING", "ABORTED", "LOST_ABORTING", "LOST"),
    # resolved_at is set exactly when a lease reaches an end state (migration 0008)
    CheckConstraint("(state IN ('COMMITTED', 'ABORTED', 'LOST')) = (resolved_at IS NOT NULL)", name="resolved"),
    Index(None, "checkpoint_id"),
    # transactions that may be open on the broker: the recovery loop, scale-down, the dashboard,
    # through the view unresolved_leases (`resolved_at IS NULL`); no index covers `state`, so a
    # change between unresolved states (the decision among them) is a HOT update.
    Index("ix_lease_rows_unresolved", "sink_id", postgresql_where=text("resolved_at IS NULL")),
)

events = Table(
    "events",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("sink_id", BigInteger, ForeignKey("sinks.id"), nullable=False),
    Column("checkpoint_id", BigInteger, ForeignKey("checkpoints.id"), nullable=True),
    Column("at", TS, nullable=False),
    Column("kind", String(64), nullable=False),
    Column("actor", String(200), nullable=False),
    Column("detail", JSONB, nullable=False),
    Index(None, "sink_id", "id"),
    Index(None, "checkpoint_id", postgresql_where=text("checkpoint_id IS NOT NULL")),
)

# One row per leadership (today only "recovery"): the replica whose lease has not expired runs the
# recovery loop. Acquired and renewed with one UPDATE that compares expires_at with the database's
# clock, so the replicas' clocks do not matter; `token` grows at every change of holder (fencing).
recovery_leader = Table(
    "recovery_leader",
    metadata,
    Column("name", String(100), primary_key=True),
    Column("holder", String(200), nullable=True),
    Column("token", BigInteger, nullable=False, server_default=text("0")),
    Column("acquired_at", TS, nullable=True),
    Column("expires_at", TS, nullable=False),
)


# --- views (migration 0012): read-only, not part of `metadata` (Alembic compares tables only) ---

views = MetaData()

# A first try's lease id while it lives on its attempt row: 2^50 + attempt id x 2^17 + partition
# (at most 100,000 partitions), so a read by lease id finds its attempt without a scan. Ids of
# lease rows come from their sequence, far below.
FIRST_TRY_ID_BASE = 1 << 50
FIRST_TRY_ID_STRIDE = 1 << 17


def first_try_lease_id(attempt_id: int, partition: int) -> int:
    return FIRST_TRY_ID_BASE + attempt_id * FIRST_TRY_ID_STRIDE + partition


def attempt_of_first_try_id(lease_id: int) -> int | None:
    """The attempt a first try's lease id names, or None for a lease row's id."""
    return (lease_id - FIRST_TRY_ID_BASE) // FIRST_TRY_ID_STRIDE if lease_id >= FIRST_TRY_ID_BASE else None


def _lease_view(name: str) -> Table:
    return Table(name, views, *(Column(c.name, c.type, primary_key=c.primary_key) for c in lease_rows.c))


# Every lease: lease_rows and the first tries still on attempt rows. Filter by attempt or
# checkpoint (both sides use an index); by id, see repo (a lease row's id reads lease_rows).
leases = _lease_view("leases")

# Leases that may hold an open transaction: unresolved lease rows and the unresolved first tries of
# unfinished attempts (ix_lease_rows_unresolved, ix_attempts_open). The recovery loop, scale-down
# and the dashboard read these.
unresolved_leases = _lease_view("unresolved_leases")
