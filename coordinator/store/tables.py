"""The schema, as SQLAlchemy Core tables: one table per entity, one layout each. Alembic's
migrations create exactly this (tests/store/test_migrations.py checks that the migrated database
and this metadata agree).

Two of the protocol's rules are also held by the database itself, as a last line of defence:
- I3: `uq_leases_held`, a unique index on (sink, pool ordinal) over unresolved leases: no id is
  ever held by two leases that may hold a transaction;
- one decided attempt per checkpoint: `checkpoints.committed_attempt` is one value.
"""

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
from sqlalchemy.dialects.postgresql import JSONB

from ..protocol.states import AttemptState, CheckpointState, LeaseState, UNRESOLVED_LEASE_STATES

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


def _in(states: object) -> str:
    return "(" + ", ".join(f"'{s}'" for s in sorted(str(x) for x in states)) + ")"  # type: ignore[attr-defined]


def _states(enum: object) -> CheckConstraint:
    return CheckConstraint(f"state IN {_in(list(enum))}", name="state")  # type: ignore[call-overload]


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

# A sink's id pool: ordinals 0..size-1 exist; which are free follows from the unresolved leases and
# the quarantine (no row per id). Locked by every grant of ids, so grants of one sink take turns.
id_pools = Table(
    "id_pools",
    metadata,
    Column("sink_id", BigInteger, ForeignKey("sinks.id"), primary_key=True),
    Column("size", Integer, nullable=False, server_default=text("0")),
    Column("cursor", Integer, nullable=False, server_default=text("0")),
)

# Ids that may not be leased before `until` (a try that did not win may still reach the broker
# with them, or the lingering sweep is aborting a transaction on one). At most a row per id.
quarantined_ids = Table(
    "quarantined_ids",
    metadata,
    Column("sink_id", BigInteger, ForeignKey("sinks.id"), primary_key=True),
    Column("ordinal", Integer, primary_key=True),
    Column("until", TS, nullable=False),
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
    # the digest of the offsets Spark planned for the batch, bound at the first begin that names them
    Column("offsets_digest", String(128), nullable=True),
    # set when an old COMMITTED batch's attempts, leases and events were pruned (the row stays, to
    # answer a replay of the batch id)
    Column("history_pruned_at", TS, nullable=True),
    UniqueConstraint("sink_id", "query_id", "batch_id"),
    _states(CheckpointState),
    CheckConstraint("history_pruned_at IS NULL OR state = 'COMMITTED'", name="pruned_committed"),
    Index(None, "sink_id", "batch_id"),
    # decided commits still to finish or to look at: the recovery loop's first read
    Index("ix_checkpoints_decided", "sink_id", postgresql_where=text("state IN ('COMMITTING', 'LOST')")),
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
    UniqueConstraint("checkpoint_id", "number"),
    UniqueConstraint("id", "checkpoint_id", "sink_id"),  # the key of the leases' foreign key
    _states(AttemptState),
    # the sink's open attempts (begin and a new generation abort them)
    Index("ix_attempts_open", "sink_id", postgresql_where=text("state = 'OPEN'")),
    # a generation start's answer: the attempts it fenced
    Index("ix_attempts_aborted", "sink_id", postgresql_where=text("abort_reason IS NOT NULL")),
)

leases = Table(
    "leases",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("sink_id", BigInteger, nullable=False),
    Column("checkpoint_id", BigInteger, nullable=False),
    Column("attempt_id", BigInteger, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("task_attempt_id", BigInteger, nullable=True),  # NULL while PRELEASED
    Column("ordinal", Integer, nullable=False),
    Column("transactional_id", String(255), nullable=False),
    Column("state", String(16), nullable=False),
    Column("taken_at", TS, nullable=False),
    Column("leased_at", TS, nullable=False),
    Column("deadline_at", TS, nullable=False),
    Column("producer_id", BigInteger, nullable=True),
    Column("producer_epoch", Integer, nullable=True),
    Column("records", BigInteger, nullable=True),
    Column("bytes", BigInteger, nullable=True),
    Column("write_ms", BigInteger, nullable=True),
    # JSON text [[topic, partition, offset], ...]: the first offset the transaction wrote per
    # topic-partition; parsed only when Kafka refuses the commit
    Column("first_offsets", Text, nullable=True),
    Column("resolved_at", TS, nullable=True),
    # one lease per try and partition of an attempt, and one pre-lease (NULL try) per partition
    UniqueConstraint("attempt_id", "partition", "task_attempt_id", postgresql_nulls_not_distinct=True),
    ForeignKeyConstraint(["attempt_id", "checkpoint_id", "sink_id"],
                         ["attempts.id", "attempts.checkpoint_id", "attempts.sink_id"]),
    _states(LeaseState),
    CheckConstraint(f"(state IN {_in(UNRESOLVED_LEASE_STATES)}) = (resolved_at IS NULL)", name="resolved"),
    Index(None, "checkpoint_id"),
    # I3: an id is held by at most one lease that may hold a transaction; also the index of every
    # read of the transactions that may be open (the recovery loop, the pool, the dashboard)
    Index("uq_leases_held", "sink_id", "ordinal", unique=True, postgresql_where=text("resolved_at IS NULL")),
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
# recovery loop. Taken and renewed with one UPDATE that compares expires_at with the database's
# clock, so the replicas' clocks do not matter; `token` grows at every change of holder.
recovery_leader = Table(
    "recovery_leader",
    metadata,
    Column("name", String(100), primary_key=True),
    Column("holder", String(200), nullable=True),
    Column("token", BigInteger, nullable=False, server_default=text("0")),
    Column("acquired_at", TS, nullable=True),
    Column("expires_at", TS, nullable=False),
)
