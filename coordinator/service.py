"""The coordinator's operations: each one reads the durable state, asks the protocol rules what
to do, writes the decision with compare-and-set in one Postgres transaction, and only then acts
on Kafka through the control plane. No database transaction is held open across a Kafka call.

Every operation is safe to retry: the same request finds its own earlier effect and answers
from it (natural keys: run id, (checkpoint, generation), (attempt, partition, task attempt id),
the stored pre-commit values, the decided winners).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, func, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError, IntegrityError

from . import metrics
from .clock import Clock, SystemClock
from .kafka_control import (
    ControlPlaneError,
    KafkaControlPlane,
    KafkaTarget,
    OpenTransaction,
    PreparedTransaction,
)
from .protocol import errors as e
from .protocol import recovery_rules, rules
from .protocol.invariants import Snapshot
from .protocol.model import Attempt, Checkpoint, Lease, PartitionResult, Sink
from .protocol.rules import BeginAction, PrecommitRequest
from .protocol.states import (
    ABORT_PENDING_STATES,
    LOST_LEASE_STATES,
    UNDECIDED_LEASE_STATES,
    UNRESOLVED_LEASE_STATES,
    AttemptState,
    CheckpointState,
    LeaseState,
)
from .store import repo
from .store.tables import (
    attempts,
    checkpoints,
    events,
    generations,
    leases,
    sinks,
    transactional_ids,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Postgres codes worth retrying the whole transaction for: serialization failure, deadlock.
_RETRYABLE_SQLSTATES = {"40001", "40P01"}


@dataclass(frozen=True)
class Limits:
    max_partitions: int = 4096
    broker_max_transaction_timeout_ms: int = 900_000  # Kafka's default transaction.max.timeout.ms
    restart_budget_ms: int = 60_000
    # Kafka commits/aborts of one checkpoint run this many at a time; 1 runs them in order (the
    # simulation needs that, so a seed replays the same schedule).
    kafka_parallelism: int = 16


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
class PoolUsage:
    size: int  # transactional ids created so far (the pool grows on demand)
    leased: int  # of them held by an unresolved lease
    max_size: int  # the sink's max_pool_size


class Coordinator:
    def __init__(
        self,
        engine: Engine,
        control_plane: KafkaControlPlane | None,
        clock: Clock | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.engine = engine
        self.control_plane = control_plane
        self.clock = clock or SystemClock()
        self.limits = limits or Limits()
        self._kafka_pool = ThreadPoolExecutor(max_workers=self.limits.kafka_parallelism, thread_name_prefix="kafka-control")

    def close(self) -> None:
        self._kafka_pool.shutdown(wait=True)
        if self.control_plane is not None:
            self.control_plane.close()

    # --- transactions ------------------------------------------------------------------------

    def _tx(self, fn: Callable[[Connection], T]) -> T:
        """Run fn in one database transaction, retrying it whole on deadlock, serialization failure
        or a dead pooled connection (safe: fn has no effect outside the transaction)."""
        for attempt in range(5):
            try:
                with self.engine.begin() as conn:
                    return fn(conn)
            except DBAPIError as exc:
                code = getattr(exc.orig, "sqlstate", None)
                if (code not in _RETRYABLE_SQLSTATES and not exc.connection_invalidated) or attempt == 4:
                    raise
                log.info("retrying transaction after %s", code or "a lost database connection")
        raise AssertionError("unreachable")

    # --- sinks -------------------------------------------------------------------------------

    def register_sink(self, spec: SinkSpec, actor: str, *, check_broker: bool = True) -> tuple[Sink, bool]:
        """Returns (sink, created). Registering the same spec again returns the same sink. A new
        sink is first checked against its broker (when a control plane is configured)."""
        rules.validate_sink_name(spec.name)
        rules.validate_prefix(spec.transactional_id_prefix)
        margin = spec.commit_margin_ms
        if margin is None:
            margin = rules.default_commit_margin_ms(spec.transaction_timeout_ms)
        rules.validate_timeouts(spec.transaction_timeout_ms, margin, self.limits.broker_max_transaction_timeout_ms)
        if check_broker and self.control_plane is not None:
            with self.engine.connect() as conn:
                known = conn.execute(select(sinks.c.id).where(sinks.c.name == spec.name)).first() is not None
            if not known:  # a retried registration answers from the record, whatever the broker says now
                self._check_new_sink_broker(spec)
        max_pool = spec.max_pool_size or 4 * self.limits.max_partitions
        values = dict(
            name=spec.name,
            transactional_id_prefix=spec.transactional_id_prefix,
            bootstrap_servers=spec.bootstrap_servers,
            topics=list(spec.topics),
            transaction_timeout_ms=spec.transaction_timeout_ms,
            commit_margin_ms=margin,
            max_pool_size=max_pool,
        )

        def step(conn: Connection) -> tuple[Sink, bool]:
            # one registration at a time: the prefix-clash check reads all prefixes
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('coordinator.sink_registration'))"))
            existing = conn.execute(select(sinks).where(sinks.c.name == spec.name)).first()
            if existing is not None:
                if {k: existing._mapping[k] for k in values} != values:
                    raise e.Conflict(
                        e.SINK_EXISTS,
                        f"a sink named {spec.name!r} exists with a different configuration",
                        existing={k: existing._mapping[k] for k in values},
                    )
                return repo.sink_by_name(conn, spec.name), False
            clash = conn.execute(
                select(sinks.c.name, sinks.c.transactional_id_prefix).where(
                    func.starts_with(sinks.c.transactional_id_prefix, spec.transactional_id_prefix)
                    | func.starts_with(spec.transactional_id_prefix, sinks.c.transactional_id_prefix)
                )
            ).first()
            if clash is not None:
                raise e.Conflict(
                    e.PREFIX_CLASH,
                    f"transactional_id_prefix {spec.transactional_id_prefix!r} overlaps sink "
                    f"{clash.name!r}'s prefix {clash.transactional_id_prefix!r}; prefixes must not "
                    "start one another, or their transactions could not be told apart",
                    other_sink=clash.name,
                )
            now = self.clock.now()
            sink_id = conn.execute(insert(sinks).values(created_at=now, **values).returning(sinks.c.id)).scalar_one()
            repo.add_event(conn, sink_id, "sink_registered", actor, now, **values)
            return repo.sink_by_name(conn, spec.name), True

        return self._tx(step)

    def _check_new_sink_broker(self, spec: SinkSpec) -> None:
        assert self.control_plane is not None
        target = KafkaTarget(spec.name, spec.bootstrap_servers, spec.transaction_timeout_ms)
        checks = self.control_plane.check_broker(target, spec.transactional_id_prefix + "-", set())
        failed = [c for c in checks if not c.ok and c.verified]
        if failed:
            raise e.Invalid(
                "broker_check_failed",
                "the sink's broker failed its checks: "
                + "; ".join(f"{c.name}: {c.verdict}" + (f" (fix: {c.fix})" if c.fix else "") for c in failed)
                + ". Register with check_broker=false to skip (e.g. before Kafka exists).",
                field="bootstrap_servers",
                checks=[asdict(c) for c in checks],
            )

    def list_sinks(self) -> list[Sink]:
        with self.engine.connect() as conn:
            return [repo.sink_by_name(conn, n) for n in conn.execute(select(sinks.c.name).order_by(sinks.c.name)).scalars()]

    def get_sink(self, name: str) -> Sink:
        with self.engine.connect() as conn:
            return repo.sink_by_name(conn, name)

    def rotate_writer_token(self, name: str, actor: str) -> Sink:
        def step(conn: Connection) -> Sink:
            sink = repo.sink_by_name(conn, name, lock="update")
            conn.execute(
                update(sinks).where(sinks.c.id == sink.id).values(writer_token_version=sink.writer_token_version + 1)
            )
            repo.add_event(conn, sink.id, "writer_token_rotated", actor, self.clock.now())
            return repo.sink_by_name(conn, name)

        return self._tx(step)

    # --- generations and lineage --------------------------------------------------------------

    def start_generation(self, name: str, query_id: str, run_id: str, actor: str) -> tuple[int, AbortOutcome]:
        """A Spark query (re)started: fence every older driver, bind or check the lineage."""

        def step(conn: Connection) -> tuple[int, list[Lease]]:
            sink = repo.sink_by_name(conn, name, lock="update")
            known = conn.execute(
                select(generations.c.generation).where(generations.c.sink_id == sink.id, generations.c.run_id == run_id)
            ).scalar()
            if known is not None:
                rules.check_generation(sink.generation, known)  # a retry answers the same
                return known, []
            rules.check_lineage(sink.lineage_query_id, query_id)
            now = self.clock.now()
            gen = sink.generation + 1
            conn.execute(update(sinks).where(sinks.c.id == sink.id).values(generation=gen, lineage_query_id=query_id))
            conn.execute(
                insert(generations).values(sink_id=sink.id, generation=gen, query_id=query_id, run_id=run_id, started_at=now)
            )
            to_abort = self._abort_open_attempts(conn, sink, _fenced_by(gen), now)
            repo.add_event(conn, sink.id, "generation_started", actor, now, generation=gen, query_id=query_id, run_id=run_id)
            return gen, to_abort

        gen, to_abort = self._tx(step)
        self._abort_on_kafka(name, to_abort)
        # answered from the record, so a retry gets the same answer
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            fenced = repo.leases_where(
                conn,
                leases.c.sink_id == sink.id,
                leases.c.attempt_id.in_(
                    select(attempts.c.id).where(attempts.c.sink_id == sink.id, attempts.c.abort_reason == _fenced_by(gen))
                ),
                leases.c.state.in_([LeaseState.ABORTED.value, LeaseState.ABORTING.value]),
            )
        return gen, AbortOutcome(
            aborted=[x.transactional_id for x in fenced if x.state is LeaseState.ABORTED],
            pending=[x.transactional_id for x in fenced if x.state is LeaseState.ABORTING],
        )

    def reset_lineage(self, name: str, actor: str, reason: str) -> Sink:
        """Operator action: let a query with a new checkpoint location take over the sink. Fences
        the current driver and aborts whatever it has open."""

        def step(conn: Connection) -> list[Lease]:
            sink = repo.sink_by_name(conn, name, lock="update")
            committing = conn.execute(
                select(checkpoints.c.batch_id).where(
                    checkpoints.c.sink_id == sink.id, checkpoints.c.state == CheckpointState.COMMITTING.value
                )
            ).scalars().all()
            if committing:
                raise e.Conflict(
                    e.COMMIT_IN_PROGRESS,
                    f"batches {list(committing)} have a decided commit still finishing; resume them first",
                    batch_ids=list(committing),
                )
            now = self.clock.now()
            to_abort = self._abort_open_attempts(conn, sink, "lineage_reset", now)
            conn.execute(
                update(sinks).where(sinks.c.id == sink.id).values(generation=sink.generation + 1, lineage_query_id=None)
            )
            repo.add_event(
                conn, sink.id, "lineage_reset", actor, now, previous_query_id=sink.lineage_query_id, reason=reason
            )
            return to_abort

        to_abort = self._tx(step)
        self._abort_on_kafka(name, to_abort)
        return self.get_sink(name)

    # --- begin checkpoint ---------------------------------------------------------------------

    def begin_checkpoint(self, name: str, batch_id: int, generation: int, actor: str) -> BeginResult:
        def step(conn: Connection) -> tuple[BeginAction, Checkpoint, Attempt | None, list[Lease], list[int], list[Lease]]:
            sink = repo.sink_by_name(conn, name)
            rules.check_generation(sink.generation, generation)
            rules.check_not_halted(sink)  # lost data: no new batch until an operator acknowledges
            if sink.lineage_query_id is None:  # only after a lineage reset, before a new start
                raise e.Conflict(e.LINEAGE_NOT_BOUND, "no query is bound to this sink; start a generation first")
            now = self.clock.now()
            conn.execute(
                pg_insert(checkpoints)
                .values(
                    sink_id=sink.id,
                    query_id=sink.lineage_query_id,
                    batch_id=batch_id,
                    state=CheckpointState.OPEN.value,
                    current_attempt=0,
                    created_at=now,
                )
                .on_conflict_do_nothing()
            )
            cp = repo.checkpoint_for(conn, sink, batch_id, lock=True)
            latest = repo.attempt_of(conn, cp.id, cp.current_attempt) if cp.current_attempt else None
            action = rules.decide_begin(cp.state, latest, generation)
            to_abort: list[Lease] = []
            if action is BeginAction.NEW_ATTEMPT:
                # one micro-batch in flight per query: every other open attempt of the sink is dead
                to_abort = self._abort_open_attempts(conn, sink, "superseded", now)
                number = cp.current_attempt + 1
                latest = repo.as_attempt(
                    conn.execute(
                        insert(attempts)
                        .values(
                            checkpoint_id=cp.id,
                            sink_id=sink.id,
                            number=number,
                            generation=generation,
                            state=AttemptState.OPEN.value,
                            started_at=now,
                        )
                        .returning(*attempts.c)
                    ).one()
                )
                conn.execute(update(checkpoints).where(checkpoints.c.id == cp.id).values(current_attempt=number))
                cp = replace(cp, current_attempt=number)
                repo.add_event(conn, sink.id, "attempt_begun", actor, now, cp.id, batch_id=batch_id, attempt=number, generation=generation)
            unfinished = conn.execute(
                select(checkpoints.c.id).where(
                    checkpoints.c.sink_id == sink.id,
                    checkpoints.c.state == CheckpointState.COMMITTING.value,
                    checkpoints.c.id != cp.id,
                )
            ).scalars().all()
            return action, cp, latest, to_abort, list(unfinished), self._older_leases(conn, cp.id, latest)

        action, cp, attempt, to_abort, unfinished, older = self._tx(step)
        finished = list(unfinished)
        try:
            for other in unfinished:  # decided commits of earlier batches finish first
                self._finish_commit(name, other)
            if action is BeginAction.RESUME:
                self._finish_commit(name, cp.id)
                finished.append(cp.id)
        except e.Conflict as exc:
            if exc.reason != e.DATA_LOST:
                raise
            self._abort_on_kafka(name, to_abort)
            rules.check_not_halted(self.get_sink(name))  # the loss just halted the sink: say so
            raise
        # a finished commit's losers (left ABORTING when its first try failed) end too, as in resume
        kafka_work = [*to_abort, *self._aborting_leases(finished)]
        if kafka_work or action is BeginAction.RESUME:
            self._abort_on_kafka(name, kafka_work)
            with self.engine.connect() as conn:  # answer with the states Kafka work left behind
                cp = repo.checkpoint_for(conn, repo.sink_by_name(conn, name), batch_id)
                attempt = repo.attempt_of(conn, cp.id, cp.current_attempt) if cp.current_attempt else None
                older = self._older_leases(conn, cp.id, attempt)
        return BeginResult(
            action=action,
            checkpoint=cp,
            attempt=attempt,
            older_aborted=[x.transactional_id for x in older if x.state is LeaseState.ABORTED],
            older_abort_pending=[x.transactional_id for x in older if x.state is LeaseState.ABORTING],
        )

    @staticmethod
    def _older_leases(conn: Connection, checkpoint_id: int, current: Attempt | None) -> list[Lease]:
        """Leases of the checkpoint's earlier attempts that were aborted or are still to abort."""
        return repo.leases_where(
            conn,
            leases.c.checkpoint_id == checkpoint_id,
            leases.c.attempt_id != (current.id if current else -1),
            leases.c.state.in_([LeaseState.ABORTED.value, LeaseState.ABORTING.value]),
        )

    def _abort_open_attempts(self, conn: Connection, sink: Sink, reason: str, now: datetime) -> list[Lease]:
        """Abort every OPEN attempt of the sink (one micro-batch is in flight per query, so any
        other open attempt is dead once a new one begins or a new generation starts)."""
        open_ids = conn.execute(
            select(attempts.c.id)
            .where(attempts.c.sink_id == sink.id, attempts.c.state == AttemptState.OPEN.value)
            .order_by(attempts.c.id)
            .with_for_update()
        ).scalars().all()
        return self._abort_attempt_rows(conn, sink, list(open_ids), reason, now, "coordinator")

    def _abort_attempt_rows(
        self, conn: Connection, sink: Sink, attempt_ids: list[int], reason: str, now: datetime, actor: str
    ) -> list[Lease]:
        """Mark the attempts ABORTED and their undecided leases ABORTING; returns the leases whose
        transactions must now be aborted on Kafka. Their ids stay LEASED until that is done, so
        none is re-leased while it may hold a transaction (I3, and scale-down for free)."""
        aborted = repo.cas(
            conn, attempts, attempt_ids, [AttemptState.OPEN], AttemptState.ABORTED, finished_at=now, abort_reason=reason
        )
        if not aborted:
            return []
        undecided = repo.leases_where(
            conn,
            leases.c.attempt_id.in_([a.id for a in aborted]),
            leases.c.state.in_([s.value for s in UNDECIDED_LEASE_STATES]),
            lock=True,
        )
        changed = repo.cas(conn, leases, [x.id for x in undecided], UNDECIDED_LEASE_STATES, LeaseState.ABORTING)
        for a in aborted:
            repo.add_event(conn, sink.id, "attempt_aborted", actor, now, a.checkpoint_id, attempt=a.number, reason=reason)
        return [repo.as_lease(r) for r in changed]

    # --- leases -------------------------------------------------------------------------------

    def begin_partition(
        self, name: str, batch_id: int, attempt_number: int, generation: int, partition: int, task_attempt_id: int
    ) -> Lease:
        """Lease a transactional id to one task attempt of one partition."""
        rules.check_partition(partition, self.limits.max_partitions)

        def existing(conn: Connection, attempt_id: int) -> Lease | None:
            found = repo.leases_where(
                conn,
                leases.c.attempt_id == attempt_id,
                leases.c.partition == partition,
                leases.c.task_attempt_id == task_attempt_id,
            )
            if not found:
                return None
            lease = found[0]
            if lease.state not in (LeaseState.LEASED, LeaseState.PRECOMMITTED):
                raise e.Conflict(e.STALE_LEASE, f"lease {lease.id} is {lease.state}", lease_id=lease.id, lease_state=str(lease.state))
            return lease

        def step(conn: Connection) -> Lease:
            sink = repo.sink_by_name(conn, name)
            rules.check_generation(sink.generation, generation)
            cp = repo.checkpoint_for(conn, sink, batch_id)
            attempt = repo.attempt_of(conn, cp.id, attempt_number, lock="key_share")
            again = existing(conn, attempt.id)
            if again is not None:
                return again
            rules.check_attempt_writable(attempt, cp.current_attempt, generation)
            tid_row, tid = repo.take_free_transactional_id(
                conn, sink, lambda n: rules.transactional_id_for(sink.transactional_id_prefix, n)
            )
            now = self.clock.now()
            row = conn.execute(
                insert(leases)
                .values(
                    sink_id=sink.id,
                    checkpoint_id=cp.id,
                    attempt_id=attempt.id,
                    partition=partition,
                    task_attempt_id=task_attempt_id,
                    transactional_id=tid,
                    state=LeaseState.LEASED.value,
                    leased_at=now,
                    deadline_at=rules.transaction_deadline(now, sink.transaction_timeout_ms),
                )
                .returning(*leases.c)
            ).one()
            conn.execute(
                update(transactional_ids)
                .where(transactional_ids.c.id == tid_row, transactional_ids.c.state == "FREE")
                .values(state="LEASED", lease_id=row.id)
            )
            return repo.as_lease(row)

        try:
            return self._tx(step)
        except IntegrityError:
            # a concurrent copy of this very request won the unique (attempt, partition, task attempt)
            def again(conn: Connection) -> Lease:
                sink = repo.sink_by_name(conn, name)
                cp = repo.checkpoint_for(conn, sink, batch_id)
                lease = existing(conn, repo.attempt_of(conn, cp.id, attempt_number).id)
                assert lease is not None
                return lease

            return self._tx(again)

    def precommit(self, name: str, lease_id: int, generation: int, request: PrecommitRequest) -> Lease:
        """Store the flushed transaction's producer id, epoch and counts durably."""

        def step(conn: Connection) -> Lease:
            sink = repo.sink_by_name(conn, name)
            rules.check_generation(sink.generation, generation)
            attempt = repo.attempt_of_lease(conn, sink, lease_id, lock="key_share")  # lock order: attempt first
            lease = repo.lease_by_id(conn, sink, lease_id, lock=True)
            if rules.precommit_already_recorded(lease, request):
                return lease
            cp_current = conn.execute(
                select(checkpoints.c.current_attempt).where(checkpoints.c.id == lease.checkpoint_id)
            ).scalar_one()
            rules.check_attempt_writable(attempt, cp_current, generation)
            now = self.clock.now()
            rules.check_precommit(lease, now, sink.commit_margin_ms)
            (row,) = repo.cas(
                conn,
                leases,
                [lease.id],
                [LeaseState.LEASED],
                LeaseState.PRECOMMITTED,
                producer_id=request.producer_id,
                producer_epoch=request.producer_epoch,
                records=request.records,
                bytes=request.bytes,
                write_ms=request.write_ms,
                precommitted_at=now,
            )
            return repo.as_lease(row)

        return self._tx(step)

    # --- commit -------------------------------------------------------------------------------

    def commit(
        self,
        name: str,
        batch_id: int,
        attempt_number: int,
        generation: int,
        results: Sequence[PartitionResult],
        actor: str,
        job_ms: int | None = None,
    ) -> CommitResult:
        """Decide and finish the commit of an attempt. `job_ms` (the driver's write-job time) is
        stored on the attempt with the decision, for operators' throughput figures."""
        if self.control_plane is None:
            raise e.Unavailable(
                e.NO_CONTROL_PLANE,
                "the coordinator has no Kafka control plane configured (COORDINATOR_KAFKA_CONTROL_PLANE), "
                "so it cannot commit; nothing was decided",
            )

        def step(conn: Connection) -> tuple[int, _Decision | None, list[Lease], e.ProtocolError | None]:
            sink = repo.sink_by_name(conn, name, lock="share")
            rules.check_generation(sink.generation, generation)
            cp = repo.checkpoint_for(conn, sink, batch_id, lock=True)
            attempt = repo.attempt_of(conn, cp.id, attempt_number, lock="update")
            if cp.state is not CheckpointState.OPEN:
                if cp.committed_attempt != attempt_number:
                    raise e.Conflict(
                        e.COMMIT_DECIDED,
                        f"batch {batch_id} was committed by attempt {cp.committed_attempt}",
                        committed_attempt=cp.committed_attempt,
                    )
                decided = repo.leases_where(  # the winners, including any Kafka refused (lost)
                    conn,
                    leases.c.attempt_id == attempt.id,
                    leases.c.state.in_([s.value for s in (LeaseState.COMMITTING, LeaseState.COMMITTED, *LOST_LEASE_STATES)]),
                )
                rules.check_same_winners(results, decided)
                # a retry: finish (if needed), end the losers' transactions still to abort, and
                # answer from the record
                return cp.id, None, self._aborting_leases([cp.id], conn), None
            if attempt.state is AttemptState.ABORTED and attempt.abort_reason == e.DEADLINE_TOO_CLOSE:
                raise e.Conflict(e.DEADLINE_TOO_CLOSE, f"attempt {attempt_number} was aborted by the timeout gate")
            rules.check_attempt_writable(attempt, cp.current_attempt, generation)
            attempt_leases = repo.leases_where(conn, leases.c.attempt_id == attempt.id, lock=True)
            now = self.clock.now()
            try:
                plan = rules.plan_commit(attempt_leases, results, self.limits.max_partitions)
            except e.Conflict as refusal:
                named = {x.id: x for x in attempt_leases}.get(refusal.detail.get("lease_id", -1))
                if refusal.reason != e.WINNER_NOT_PRECOMMITTED or named is None:
                    raise
                if not rules.winner_expired(named, now, sink.commit_margin_ms):
                    raise
                # the recovery loop aborted it because it could no longer pass the timeout gate
                plan = rules.CommitPlan(winners=(named,), losers=())
            try:
                rules.check_commit_deadlines(plan.winners, now, sink.commit_margin_ms)
            except e.Conflict as refusal:
                to_abort = self._abort_attempt_rows(conn, sink, [attempt.id], e.DEADLINE_TOO_CLOSE, now, actor)
                repo.add_event(conn, sink.id, "commit_refused", actor, now, cp.id, attempt=attempt_number, **refusal.to_dict())
                return cp.id, None, to_abort, refusal
            (cp_row,) = repo.cas(conn, checkpoints, [cp.id], [CheckpointState.OPEN], CheckpointState.COMMITTING,
                                 decided_at=now, committed_attempt=attempt_number)
            (attempt_row,) = repo.cas(conn, attempts, [attempt.id], [AttemptState.OPEN], AttemptState.COMMITTING,
                                      decided_at=now, partitions=len(results), job_ms=job_ms)
            winners = repo.cas(conn, leases, [w.id for w in plan.winners], [LeaseState.PRECOMMITTED], LeaseState.COMMITTING)
            losers = repo.cas(conn, leases, [x.id for x in plan.losers], UNDECIDED_LEASE_STATES, LeaseState.ABORTING)
            repo.add_event(
                conn, sink.id, "commit_decided", actor, now, cp.id, batch_id=batch_id, attempt=attempt_number,
                winners=[[w.partition, w.id, w.transactional_id] for w in plan.winners],
            )
            decision = _Decision(
                sink, repo.as_checkpoint(cp_row), repo.as_attempt(attempt_row), [repo.as_lease(r) for r in winners]
            )
            return cp.id, decision, [repo.as_lease(r) for r in losers], None

        checkpoint_id, decision, to_abort, refusal = self._tx(step)
        if refusal is not None:
            metrics.checkpoint_outcome(name, "deadline_refused")
            self._abort_on_kafka(name, to_abort)
            raise refusal
        try:
            result = self._commit_winners(decision) if decision else self._finish_commit(name, checkpoint_id)
        finally:
            # losers do not depend on the winners: end their transactions (which would block
            # read_committed consumers) even while the winners' commit waits for Kafka
            self._abort_on_kafka(name, to_abort)
        if result is None or to_abort:  # the answer must show the states the aborts left
            result = self._commit_result(name, batch_id)
        return result

    def resume(self, name: str, batch_id: int) -> CommitResult:
        """Finish a decided commit (after a crash); answers from the record if it is finished."""
        with self.engine.connect() as conn:
            cp = repo.checkpoint_for(conn, repo.sink_by_name(conn, name), batch_id)
        if cp.state is CheckpointState.OPEN:
            raise e.Conflict(e.NOT_COMMITTING, f"batch {batch_id} has no decided commit to resume")
        try:
            self._finish_commit(name, cp.id)
        finally:
            self._abort_on_kafka(name, self._aborting_leases([cp.id]))
        return self._commit_result(name, batch_id)

    def _aborting_leases(self, checkpoint_ids: Sequence[int], conn: Connection | None = None) -> list[Lease]:
        """Leases of these checkpoints whose transactions are still to abort on Kafka."""
        if not checkpoint_ids:
            return []
        if conn is None:
            with self.engine.connect() as own:
                return self._aborting_leases(checkpoint_ids, own)
        return repo.leases_where(
            conn,
            leases.c.checkpoint_id.in_(list(checkpoint_ids)),
            leases.c.state.in_([s.value for s in ABORT_PENDING_STATES]),
        )

    def _commit_result(self, name: str, batch_id: int) -> CommitResult:
        """The answer to commit and resume, read from the record so that a retry (on any replica)
        answers the same."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            cp = repo.checkpoint_for(conn, sink, batch_id)
            assert cp.committed_attempt is not None
            attempt = repo.attempt_of(conn, cp.id, cp.committed_attempt)
            return self._result_from(sink, cp, attempt, repo.leases_where(conn, leases.c.checkpoint_id == cp.id))

    def _result_from(self, sink: Sink, cp: Checkpoint, attempt: Attempt, checkpoint_leases: list[Lease]) -> CommitResult:
        """The winners, and every other transaction of the checkpoint as aborted or still to abort."""
        winners = [
            x for x in checkpoint_leases
            if x.attempt_id == attempt.id and x.state in (LeaseState.COMMITTING, LeaseState.COMMITTED)
        ]
        aborts = AbortOutcome(
            aborted=[x.transactional_id for x in checkpoint_leases if x.state is LeaseState.ABORTED],
            pending=[x.transactional_id for x in checkpoint_leases if x.state in ABORT_PENDING_STATES],
        )
        warnings = []
        if attempt.decided_at is not None:
            w = rules.batch_duration_warning(
                attempt.started_at, attempt.decided_at, self.limits.restart_budget_ms, sink.transaction_timeout_ms
            )
            if w:
                warnings.append(w)
        return CommitResult(checkpoint=cp, attempt=attempt, winners=winners, aborts=aborts, warnings=warnings)

    def _finish_commit(self, name: str, checkpoint_id: int) -> CommitResult | None:
        """Finish a decided commit found in the record (None if it was already finished)."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            cp = repo.as_checkpoint(conn.execute(select(checkpoints).where(checkpoints.c.id == checkpoint_id)).one())
            if cp.state is CheckpointState.COMMITTED:
                return None
            # COMMITTING, or LOST (raises data_lost after committing any winner still to commit)
            assert cp.committed_attempt is not None
            attempt = repo.attempt_of(conn, cp.id, cp.committed_attempt)
            pending = repo.leases_where(
                conn, leases.c.attempt_id == attempt.id, leases.c.state == LeaseState.COMMITTING.value
            )
        return self._commit_winners(_Decision(sink, cp, attempt, pending))

    def _commit_winners(self, decision: _Decision) -> CommitResult:
        """Commit every decided winner on Kafka by resume, then mark the checkpoint COMMITTED.
        Safe to run concurrently with itself (driver resume and recovery loop): every write is a CAS."""
        sink, cp, attempt, pending = decision.sink, decision.checkpoint, decision.attempt, decision.winners
        started = time.monotonic()
        if pending and self.control_plane is None:
            raise e.Unavailable(e.NO_CONTROL_PLANE, "no Kafka control plane configured to finish the commit")
        target = _target(sink)
        control_plane = self.control_plane

        def commit_one(lease: Lease) -> ControlPlaneError | None:
            assert control_plane is not None and lease.producer_id is not None and lease.producer_epoch is not None
            try:
                control_plane.commit(
                    target, PreparedTransaction(lease.transactional_id, lease.producer_id, lease.producer_epoch)
                )
            except ControlPlaneError as exc:
                return exc
            return None

        failures = {}
        refused: dict[str, rules.RefusedCommit] = {}  # refused for good: the data is lost
        for lease, error in zip(pending, self._parallel(commit_one, pending)):
            if error is not None:
                failures[lease.transactional_id] = str(error)
                if not error.retriable:
                    refused[lease.transactional_id] = rules.RefusedCommit(lease, error.code, str(error))
        newly_lost: list[Lease] = []
        outcome: dict[str, Any] = {}

        def record(conn: Connection) -> CommitResult | None:
            newly_lost.clear()
            outcome.clear()
            now = self.clock.now()
            if refused:  # lock order: sink before checkpoint (the halt is written on the sink)
                repo.sink_by_name(conn, sink.name, lock="update")
            locked = repo.as_checkpoint(  # lock order: checkpoint before its leases
                conn.execute(select(checkpoints).where(checkpoints.c.id == cp.id).with_for_update()).one()
            )
            done = [x.id for x in pending if x.transactional_id not in failures]
            repo.cas(conn, leases, done, [LeaseState.COMMITTING], LeaseState.COMMITTED, resolved_at=now)
            repo.release_transactional_ids(conn, done)
            # refused winners: their ids are fenced on Kafka (LOST_ABORTING) before they are free
            lost_rows = repo.cas(
                conn, leases, [r.lease.id for r in refused.values()], [LeaseState.COMMITTING], LeaseState.LOST_ABORTING
            )
            newly_lost.extend(repo.as_lease(r) for r in lost_rows)
            checkpoint_leases = repo.leases_where(conn, leases.c.checkpoint_id == cp.id)
            # a concurrent finisher (driver resume vs recovery) may have committed some already
            still_committing = {
                x.transactional_id for x in checkpoint_leases
                if x.attempt_id == attempt.id and x.state is LeaseState.COMMITTING
            }
            for tid in list(failures):
                if tid not in still_committing:
                    del failures[tid]
            if newly_lost:
                outcome["became_lost"] = locked.state is CheckpointState.COMMITTING
                locked = self._record_loss(conn, sink, locked, attempt, [refused[x.transactional_id] for x in newly_lost],
                                           sorted(still_committing), now)
            outcome["checkpoint"] = locked
            if failures:
                repo.add_event(conn, sink.id, "commit_failed", "coordinator", now, cp.id, failures=failures)
                return None
            if locked.state is CheckpointState.LOST:
                return None
            final_cp, final_attempt = locked, attempt
            if locked.state is CheckpointState.COMMITTING and not still_committing:
                (a,) = repo.cas(conn, attempts, [attempt.id], [AttemptState.COMMITTING], AttemptState.COMMITTED, finished_at=now)
                (c,) = repo.cas(conn, checkpoints, [cp.id], [CheckpointState.COMMITTING], CheckpointState.COMMITTED, committed_at=now)
                final_cp, final_attempt = repo.as_checkpoint(c), repo.as_attempt(a)
                outcome["committed_now"] = True
                repo.add_event(conn, sink.id, "checkpoint_committed", "coordinator", now, cp.id,
                               batch_id=cp.batch_id, attempt=attempt.number)
            elif locked.state is CheckpointState.COMMITTED:
                final_attempt = repo.attempt_by_id(conn, attempt.id)
            return self._result_from(sink, final_cp, final_attempt, checkpoint_leases)

        result = self._tx(record)
        final: Checkpoint = outcome["checkpoint"]
        metrics.commit_finished(sink.name, time.monotonic() - started if pending else None,
                                committed=outcome.get("committed_now", False), lost=outcome.get("became_lost", False))
        if newly_lost:  # counted after the transaction committed (it may have been retried)
            metrics.TRANSACTIONS_LOST.labels(sink.name).inc(len(newly_lost))
            metrics.SINK_HALTED.labels(sink.name).set(1)
            if outcome.get("became_lost"):
                metrics.CHECKPOINTS_LOST.labels(sink.name).inc()
            log.error("DATA LOST on sink %s: %s (sink halted until an operator acknowledges)", sink.name,
                      rules.lost_reason(cp.batch_id, [refused[x.transactional_id] for x in newly_lost]))
        if final.state is CheckpointState.LOST:
            # fence the refused winners' ids before they can be leased again (I3)
            self._abort_on_kafka(sink.name, self._aborting_leases([cp.id]))
            raise rules.data_lost(final)
        if result is None:
            raise e.Unavailable(
                "kafka_commit_failed",
                f"the commit of batch {cp.batch_id} is decided but {len(failures)} transaction(s) could "
                "not be committed on Kafka yet; retry (resume) — the decision stands",
                failures=failures,
            )
        return result

    def _record_loss(
        self,
        conn: Connection,
        sink: Sink,
        cp: Checkpoint,
        attempt: Attempt,
        refused: list[rules.RefusedCommit],
        still_committing: list[str],
        now: datetime,
    ) -> Checkpoint:
        """Kafka refused decided winners for good: the checkpoint and its attempt become LOST, the
        sink is halted, and the alert goes into the audit trail (the caller counts the metric)."""
        reason = rules.lost_reason(cp.batch_id, refused)
        if cp.state is CheckpointState.COMMITTING:
            (c,) = repo.cas(conn, checkpoints, [cp.id], [CheckpointState.COMMITTING], CheckpointState.LOST,
                            lost_reason=reason, lost_at=now)
            repo.cas(conn, attempts, [attempt.id], [AttemptState.COMMITTING], AttemptState.LOST, finished_at=now)
            cp = repo.as_checkpoint(c)
        conn.execute(
            update(sinks).where(sinks.c.id == sink.id, sinks.c.halted_at.is_(None)).values(halted_reason=reason, halted_at=now)
        )
        repo.add_event(
            conn, sink.id, "data_lost", "coordinator", now, cp.id,
            batch_id=cp.batch_id, attempt=attempt.number, reason=reason,
            lost=[
                dict(partition=r.lease.partition, lease_id=r.lease.id, transactional_id=r.lease.transactional_id,
                     producer_id=r.lease.producer_id, producer_epoch=r.lease.producer_epoch,
                     records=r.lease.records, code=r.code, message=r.message[:500])
                for r in refused
            ],
            still_committing=still_committing,
        )
        return cp

    def acknowledge_lost_data(
        self, name: str, actor: str, reason: str, operator: str | None = None
    ) -> tuple[Sink, bool, list[int]]:
        """Operator action: clear a sink's lost-data halt. Returns the sink, whether it was halted,
        and the batch ids of the sink's LOST checkpoints (a retried acknowledgement, or one of a
        sink that is not halted, changes nothing and answers False)."""

        def step(conn: Connection) -> tuple[Sink, bool, list[int]]:
            sink = repo.sink_by_name(conn, name, lock="update")
            if sink.halted_at is None:
                return sink, False, []
            lost = conn.execute(
                select(checkpoints.c.batch_id).where(
                    checkpoints.c.sink_id == sink.id, checkpoints.c.state == CheckpointState.LOST.value
                ).order_by(checkpoints.c.batch_id)
            ).scalars().all()
            now = self.clock.now()
            conn.execute(update(sinks).where(sinks.c.id == sink.id).values(halted_reason=None, halted_at=None))
            repo.add_event(
                conn, sink.id, "lost_data_acknowledged", actor, now,
                reason=reason, operator=operator, halted_reason=sink.halted_reason,
                halted_at=sink.halted_at.isoformat(), lost_batches=list(lost),
            )
            return repo.sink_by_name(conn, name), True, list(lost)

        sink, was_halted, lost = self._tx(step)
        if was_halted:
            metrics.LOST_DATA_ACKNOWLEDGED.labels(name).inc()
            log.warning("sink %s: lost data acknowledged by %s (%s): %s", name, actor, operator, reason)
        metrics.SINK_HALTED.labels(name).set(0)
        return sink, was_halted, lost

    # --- abort --------------------------------------------------------------------------------

    def abort_attempt(
        self, name: str, batch_id: int, attempt_number: int, generation: int | None, reason: str, actor: str
    ) -> tuple[Attempt, AbortOutcome]:
        """Abort an undecided attempt (the driver gives up on it, or an operator does)."""

        def step(conn: Connection) -> list[Lease] | None:
            sink = repo.sink_by_name(conn, name)
            if generation is not None:
                rules.check_generation(sink.generation, generation)
            cp = repo.checkpoint_for(conn, sink, batch_id, lock=True)
            attempt = repo.attempt_of(conn, cp.id, attempt_number, lock="update")
            if attempt.state is AttemptState.ABORTED:
                return None  # a retry, or aborted earlier for another reason
            if attempt.state is not AttemptState.OPEN:
                raise e.Conflict(e.COMMIT_DECIDED, f"attempt {attempt_number} is {attempt.state}; it can no longer be aborted")
            now = self.clock.now()
            return self._abort_attempt_rows(conn, sink, [attempt.id], reason, now, actor)

        to_abort = self._tx(step)
        if to_abort is not None:
            metrics.checkpoint_outcome(name, "aborted")
        self._abort_on_kafka(name, to_abort or [])
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            cp = repo.checkpoint_for(conn, sink, batch_id)
            attempt = repo.attempt_of(conn, cp.id, attempt_number)
            all_leases = repo.leases_where(conn, leases.c.attempt_id == attempt.id)
        return attempt, AbortOutcome(
            aborted=[x.transactional_id for x in all_leases if x.state is LeaseState.ABORTED],
            pending=[x.transactional_id for x in all_leases if x.state is LeaseState.ABORTING],
        )

    def run_pending_aborts(self, name: str) -> AbortOutcome:
        """Abort on Kafka every transaction the database marks ABORTING (recovery loop's job)."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            pending = repo.leases_where(
                conn, leases.c.sink_id == sink.id, leases.c.state.in_([s.value for s in ABORT_PENDING_STATES])
            )
        return self._abort_on_kafka(name, pending)

    def _abort_on_kafka(self, name: str, to_abort: Sequence[Lease]) -> AbortOutcome:
        """Abort each lease's transaction by its id; only then is the id free again.

        The list was read earlier and another caller (a retried request, resume, the recovery
        loop, another replica) may be aborting the same leases. An abort by id fences whatever
        producer holds the id, so it must never reach Kafka after the id was released and leased
        again (it would kill the new lease's transaction, even a pre-committed one). Each lease is
        therefore claimed with a session advisory lock (no transaction is held across Kafka) and
        re-checked to be still ABORTING; a lease claimed elsewhere is left to that caller."""
        if not to_abort:
            return AbortOutcome()
        if self.control_plane is None:
            return AbortOutcome(pending=[x.transactional_id for x in to_abort])
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as guard:
            try:
                return self._abort_claimed(name, guard, list({x.id: x for x in to_abort}.values()))
            finally:
                guard.execute(text("SELECT pg_advisory_unlock_all()"))

    def _abort_claimed(self, name: str, guard: Connection, candidates: list[Lease]) -> AbortOutcome:
        claimed = {
            x.id for x in candidates
            if guard.execute(
                text("SELECT pg_try_advisory_lock(hashtextextended('coordinator.lease_abort:' || :id, 0))"),
                {"id": str(x.id)},
            ).scalar()
        }
        # read after claiming: a lease still ABORTING now cannot be released by anyone but us
        states = dict(
            guard.execute(select(leases.c.id, leases.c.state).where(leases.c.id.in_([x.id for x in candidates]))).all()
        )
        pending_states = {s.value for s in ABORT_PENDING_STATES}
        ended_states = {s.value for s in ABORT_PENDING_STATES.values()}
        to_abort = [x for x in candidates if x.id in claimed and states.get(x.id) in pending_states]
        already = [x.transactional_id for x in candidates if states.get(x.id) in ended_states]
        elsewhere = [
            x.transactional_id for x in candidates
            if x.id not in claimed and states.get(x.id) not in ended_states
        ]
        if not to_abort:
            return AbortOutcome(aborted=already, pending=elsewhere)
        control_plane = self.control_plane
        assert control_plane is not None
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
        target = _target(sink)

        def abort_one(lease: Lease) -> ControlPlaneError | None:
            started = time.monotonic()
            try:
                control_plane.abort(target, lease.transactional_id)
            except ControlPlaneError as exc:
                return exc
            finally:
                metrics.kafka_abort_finished(sink.name, time.monotonic() - started)
            return None

        errors = self._parallel(abort_one, list(to_abort))
        done = [x for x, err in zip(to_abort, errors) if err is None]
        failed = {x.transactional_id: str(err) for x, err in zip(to_abort, errors) if err is not None}

        def record(conn: Connection) -> None:
            now = self.clock.now()
            changed = []
            for old, new in ABORT_PENDING_STATES.items():  # ABORTING -> ABORTED, LOST_ABORTING -> LOST
                changed += repo.cas(conn, leases, [x.id for x in done if states[x.id] == old.value], [old], new,
                                    resolved_at=now)
            repo.release_transactional_ids(conn, [r.id for r in changed])
            if changed:
                repo.add_event(conn, sink.id, "transactions_aborted", "coordinator", now,
                               transactional_ids=[r.transactional_id for r in changed])
            if failed:
                repo.add_event(conn, sink.id, "abort_failed", "coordinator", now, failures=failed)

        self._tx(record)
        return AbortOutcome(aborted=[*already, *(x.transactional_id for x in done)], pending=[*elsewhere, *failed])

    def _parallel(self, fn: Callable[[Lease], T], items: Sequence[Lease]) -> list[T]:
        if len(items) <= 1 or self.limits.kafka_parallelism == 1:
            return [fn(x) for x in items]
        return list(self._kafka_pool.map(fn, items))

    # --- recovery (driven by coordinator/recovery.py) ------------------------------------------

    def finish_decided_commits(self, name: str) -> FinishOutcome:
        """Finish every decided commit of the sink (COMMITTING checkpoints, and winners of LOST
        ones still to commit), then end their losers' transactions. Nobody needs to call back."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            candidates = [
                repo.as_checkpoint(r) for r in conn.execute(
                    select(checkpoints).where(
                        checkpoints.c.sink_id == sink.id,
                        checkpoints.c.state.in_([CheckpointState.COMMITTING.value, CheckpointState.LOST.value]),
                    )
                )
            ]
            committing = repo.leases_where(
                conn, leases.c.sink_id == sink.id, leases.c.state == LeaseState.COMMITTING.value
            ) if candidates else []
        by_id = {c.id: c for c in candidates}
        out = FinishOutcome()
        for cp_id in recovery_rules.checkpoints_to_finish(candidates, committing):
            batch = by_id[cp_id].batch_id
            try:
                try:
                    self._finish_commit(name, cp_id)
                finally:
                    self._abort_on_kafka(name, self._aborting_leases([cp_id]))
                out.committed.append(batch)
            except e.Conflict as exc:
                if exc.reason != e.DATA_LOST:
                    raise
                out.lost.append(batch)
            except (e.Unavailable, ControlPlaneError) as exc:
                out.failed[batch] = str(exc)
        return out

    def abort_expired_leases(self, name: str) -> tuple[list[Lease], AbortOutcome]:
        """Abort the undecided leases of open attempts whose transactions can no longer pass the
        commit gate (an executor died, or a driver vanished mid-batch). Their ids stay LEASED
        until the abort is done on Kafka (I3)."""

        def step(conn: Connection) -> list[Lease]:
            sink = repo.sink_by_name(conn, name)
            open_attempts = select(attempts.c.id).where(
                attempts.c.sink_id == sink.id, attempts.c.state == AttemptState.OPEN.value
            )
            candidates = repo.leases_where(
                conn,
                leases.c.sink_id == sink.id,
                leases.c.state.in_([x.value for x in UNDECIDED_LEASE_STATES]),
                leases.c.attempt_id.in_(open_attempts),
            )
            attempt_rows = [repo.attempt_by_id(conn, a) for a in {x.attempt_id for x in candidates}]
            now = self.clock.now()
            expired = recovery_rules.expired_leases(candidates, attempt_rows, now, sink.commit_margin_ms)
            if not expired:
                return []
            # lock order: leases by id (as commit does); the CAS re-checks state and the open attempt
            repo.leases_where(conn, leases.c.id.in_([x.id for x in expired]), lock=True)
            changed = repo.cas(
                conn, leases, [x.id for x in expired], UNDECIDED_LEASE_STATES, LeaseState.ABORTING,
                where=[leases.c.attempt_id.in_(open_attempts)],
            )
            for cp_id in sorted({r.checkpoint_id for r in changed}):
                repo.add_event(
                    conn, sink.id, "expired_leases_aborted", "recovery", now, cp_id,
                    leases=[[r.id, r.partition, r.transactional_id, str(r.deadline_at)] for r in changed
                            if r.checkpoint_id == cp_id],
                )
            return [repo.as_lease(r) for r in changed]

        expired = self._tx(step)
        if expired:
            metrics.EXPIRED_LEASES_ABORTED.labels(name).inc(len(expired))
        return expired, self._abort_on_kafka(name, expired)

    def warn_near_timeout(self, name: str, fraction: float = recovery_rules.WARN_FRACTION) -> tuple[list[Lease], list[Lease]]:
        """Pre-committed or committing transactions past `fraction` of their lifetime. Returns
        (all of them, those warned about for the first time: a `transaction_near_timeout` event each)."""

        def step(conn: Connection) -> tuple[list[Lease], list[Lease]]:
            sink = repo.sink_by_name(conn, name)
            live = repo.leases_where(
                conn,
                leases.c.sink_id == sink.id,
                leases.c.state.in_([LeaseState.PRECOMMITTED.value, LeaseState.COMMITTING.value]),
            )
            now = self.clock.now()
            near = recovery_rules.near_timeout(live, now, sink.transaction_timeout_ms, fraction)
            if not near:
                return [], []
            warned = set(conn.execute(
                select(events.c.detail["lease_id"].as_integer()).where(
                    events.c.sink_id == sink.id,
                    events.c.kind == "transaction_near_timeout",
                    events.c.checkpoint_id.in_(sorted({x.checkpoint_id for x in near})),
                )
            ).scalars())
            new = [x for x in near if x.id not in warned]
            for x in new:
                repo.add_event(
                    conn, sink.id, "transaction_near_timeout", "recovery", now, x.checkpoint_id,
                    lease_id=x.id, transactional_id=x.transactional_id, state=str(x.state),
                    age_fraction=round(rules.transaction_age_fraction(x, now, sink.transaction_timeout_ms), 3),
                    remaining_ms=rules.remaining_ms(x, now),
                )
            return near, new

        near, new = self._tx(step)
        metrics.TRANSACTIONS_NEAR_TIMEOUT.labels(name).set(len(near))
        if new:
            metrics.TRANSACTION_TIMEOUT_WARNINGS.labels(name).inc(len(new))
            for x in new:
                log.warning("sink %s: transaction %s (lease %s, %s) is past %d%% of its timeout", name,
                            x.transactional_id, x.id, x.state, int(fraction * 100))
        return near, new

    def sweep_lingering(self, name: str) -> SweepOutcome:
        """Abort the open transactions under the sink's prefix that the database does not explain
        (DESIGN.md §3 step 6, I6): left by a lost lease record, an old deployment, or a producer
        that outlived its lease.

        Each abort runs while the id's pool row is locked FOR UPDATE NOWAIT and FREE (or, for an
        id not in the pool, while the pool cannot grow), so no lease of that id can be granted
        while the abort is on its way: it can never fence a newly leased producer. This is the one
        place a database transaction stays open across a Kafka call; it blocks nobody, because
        lease grants skip locked rows."""
        if self.control_plane is None:
            raise e.Unavailable(e.NO_CONTROL_PLANE, "no Kafka control plane configured to sweep the broker")
        sink = self.get_sink(name)
        target = _target(sink)
        open_now = self.control_plane.list_open_transactions(target, sink.transactional_id_prefix + "-")
        if not open_now:
            return SweepOutcome()
        # read after listing: a transaction open at listing time was leased before it (a lease is
        # durable before its producer exists), so an id free now had its lease resolved since
        unresolved = self.possibly_open_transactions(name)
        found = recovery_rules.lingering(open_now, unresolved)
        if not found:
            return SweepOutcome()
        metrics.LINGERING_FOUND.labels(name).inc(len(found))
        now = self.clock.now()
        self._tx(lambda conn: repo.add_event(
            conn, sink.id, "lingering_transactions_found", "recovery", now,
            transactions=[dict(transactional_id=t.transactional_id, producer_id=t.producer_id,
                               producer_epoch=t.producer_epoch, state=t.state, started_at_ms=t.started_at_ms,
                               partitions=[list(p) for p in t.partitions]) for t in found],
        ))
        log.warning("sink %s: %d lingering transaction(s) the database does not explain: %s", name, len(found),
                    [t.transactional_id for t in found])
        aborted: list[str] = []
        skipped: list[str] = []
        failed: dict[str, str] = {}
        for t in found:
            verdict = self._abort_lingering(sink, target, t)
            if verdict is None:
                aborted.append(t.transactional_id)
            elif verdict == "skipped":
                skipped.append(t.transactional_id)
            else:
                failed[t.transactional_id] = verdict
        if aborted:
            metrics.LINGERING_ABORTED.labels(name).inc(len(aborted))
        return SweepOutcome(found=found, aborted=aborted, skipped=skipped, failed=failed)

    def _abort_lingering(self, sink: Sink, target: KafkaTarget, txn: OpenTransaction) -> str | None:
        """None if aborted, "skipped" if the id is (being) leased, else the error."""
        control_plane = self.control_plane
        assert control_plane is not None
        tid = txn.transactional_id
        try:
            with self.engine.begin() as conn:
                row = conn.execute(
                    select(transactional_ids.c.state)
                    .where(transactional_ids.c.sink_id == sink.id, transactional_ids.c.transactional_id == tid)
                    .with_for_update(nowait=True)
                ).first()
                if row is None:
                    # not in the pool: hold the pool's growth lock, then make sure it is still absent
                    conn.execute(select(func.pg_advisory_xact_lock(
                        func.hashtext("coordinator.pool_growth"), func.hashtext(str(sink.id)))))
                    row = conn.execute(
                        select(transactional_ids.c.state)
                        .where(transactional_ids.c.sink_id == sink.id, transactional_ids.c.transactional_id == tid)
                        .with_for_update(nowait=True)
                    ).first()
                if row is not None and row.state != "FREE":
                    return "skipped"  # leased since the database was read: its lease explains it
                try:
                    control_plane.abort(target, tid)
                except ControlPlaneError as exc:
                    repo.add_event(conn, sink.id, "lingering_abort_failed", "recovery", self.clock.now(),
                                   transactional_id=tid, error=str(exc))
                    return str(exc) or exc.code
                repo.add_event(conn, sink.id, "lingering_transaction_aborted", "recovery", self.clock.now(),
                               transactional_id=tid, producer_id=txn.producer_id, producer_epoch=txn.producer_epoch,
                               in_pool=row is not None)
                return None
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) == "55P03":  # lock_not_available: a lease grant holds it
                return "skipped"
            raise

    def record_operator_event(self, name: str, kind: str, actor: str, batch_id: int | None = None, **detail: Any) -> None:
        """Put an operator's action into the sink's event trail (who in `actor`, when from the clock)."""

        def step(conn: Connection) -> None:
            sink = repo.sink_by_name(conn, name)
            cp_id = repo.checkpoint_for(conn, sink, batch_id).id if batch_id is not None else None
            repo.add_event(conn, sink.id, kind, actor, self.clock.now(), cp_id, **detail)

        self._tx(step)

    # --- reads --------------------------------------------------------------------------------

    def list_checkpoints(
        self, name: str, *, state: CheckpointState | None = None, before_batch: int | None = None, limit: int = 50
    ) -> list[Checkpoint]:
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            stmt = select(checkpoints).where(
                checkpoints.c.sink_id == sink.id, checkpoints.c.query_id == sink.lineage_query_id
            )
            if state is not None:
                stmt = stmt.where(checkpoints.c.state == state.value)
            if before_batch is not None:
                stmt = stmt.where(checkpoints.c.batch_id < before_batch)
            rows = conn.execute(stmt.order_by(checkpoints.c.batch_id.desc()).limit(limit))
            return [repo.as_checkpoint(r) for r in rows]

    def checkpoint_detail(self, name: str, batch_id: int) -> CheckpointDetail:
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            cp = repo.checkpoint_for(conn, sink, batch_id)
            return CheckpointDetail(
                checkpoint=cp,
                attempts=repo.attempts_of_checkpoint(conn, cp.id),
                leases=repo.leases_where(conn, leases.c.checkpoint_id == cp.id),
            )

    def possibly_open_transactions(self, name: str) -> list[Lease]:
        """Every lease whose transactional id may hold an unresolved transaction on the broker."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            return repo.leases_where(
                conn, leases.c.sink_id == sink.id, leases.c.state.in_([s.value for s in UNRESOLVED_LEASE_STATES])
            )

    def list_events(
        self, name: str, *, after_id: int = 0, batch_id: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            stmt = select(events, checkpoints.c.batch_id).outerjoin(checkpoints, events.c.checkpoint_id == checkpoints.c.id)
            stmt = stmt.where(events.c.sink_id == sink.id, events.c.id > after_id)
            if batch_id is not None:
                stmt = stmt.where(events.c.checkpoint_id == repo.checkpoint_for(conn, sink, batch_id).id)
            return [dict(r._mapping) for r in conn.execute(stmt.order_by(events.c.id).limit(limit))]

    def recent_events(self, name: str, limit: int = 30) -> list[dict[str, Any]]:
        """The sink's newest events, newest first (list_events pages oldest first)."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            stmt = select(events, checkpoints.c.batch_id).outerjoin(checkpoints, events.c.checkpoint_id == checkpoints.c.id)
            stmt = stmt.where(events.c.sink_id == sink.id).order_by(events.c.id.desc()).limit(limit)
            return [dict(r._mapping) for r in conn.execute(stmt)]

    def checkpoint_history(self, name: str, limit: int = 50) -> list[CheckpointDetail]:
        """The newest `limit` checkpoints of the sink's current lineage with their attempts and
        leases, newest first, in three queries (the dashboard's charts and tables)."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            cps = [repo.as_checkpoint(r) for r in conn.execute(
                select(checkpoints)
                .where(checkpoints.c.sink_id == sink.id, checkpoints.c.query_id == sink.lineage_query_id)
                .order_by(checkpoints.c.batch_id.desc())
                .limit(limit)
            )]
            ids = [c.id for c in cps]
            cp_attempts = [repo.as_attempt(r) for r in conn.execute(
                select(attempts).where(attempts.c.checkpoint_id.in_(ids)).order_by(attempts.c.number)
            )] if ids else []
            cp_leases = repo.leases_where(conn, leases.c.checkpoint_id.in_(ids)) if ids else []
        return [
            CheckpointDetail(
                checkpoint=c,
                attempts=[a for a in cp_attempts if a.checkpoint_id == c.id],
                leases=[x for x in cp_leases if x.checkpoint_id == c.id],
            )
            for c in cps
        ]

    def pool_usage(self, name: str) -> PoolUsage:
        """How many of the sink's pooled transactional ids exist and how many are leased."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            rows = conn.execute(
                select(transactional_ids.c.state, func.count())
                .where(transactional_ids.c.sink_id == sink.id)
                .group_by(transactional_ids.c.state)
            ).all()
        counts = {state: n for state, n in rows}
        return PoolUsage(size=sum(counts.values()), leased=counts.get("LEASED", 0), max_size=sink.max_pool_size)

    def snapshot(self) -> Snapshot:
        with self.engine.connect() as conn:
            return repo.snapshot(conn)


def _fenced_by(generation: int) -> str:
    return f"fenced_by_generation_{generation}"


def _target(sink: Sink) -> KafkaTarget:
    return KafkaTarget(sink.name, sink.bootstrap_servers, sink.transaction_timeout_ms)
