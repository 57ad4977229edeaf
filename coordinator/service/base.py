"""What every part of the coordinator shares: the engine, control plane, clock and limits; the
database transaction helper; and the two Kafka steps that both the protocol operations and the
recovery loop run: finishing a decided commit, and aborting leases' transactions on Kafka."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, select, text, update
from sqlalchemy.exc import DBAPIError

from ..kafka.control_plane import (
    NOT_TRIED,
    ControlPlaneError,
    FirstOffset,
    KafkaControlPlane,
    KafkaTarget,
    PreparedTransaction,
    TransactionOutcome,
)
from ..protocol import errors as e
from ..protocol import rules
from ..protocol.model import Attempt, Checkpoint, Lease, Sink
from ..protocol.states import ABORT_PENDING_STATES, AttemptState, CheckpointState, LeaseState
from ..store import driver_sql, hot_path, repo
from ..store.connections import ConnectionShelf
from ..store.tables import attempts, checkpoints, lease_rows, leases, sinks, unresolved_leases
from . import kafka_passes, metrics
from .kafka_passes import failure_report
from .clock import Clock, DatabaseClock, given_now
from .results import AbortOutcome, CommitResult, Limits, _Decision

# one logger for every part of the service package
log = logging.getLogger("coordinator.service")
T = TypeVar("T")

# the actor of a checkpoint_committed event: a decided commit finished after its commit call
RECOVERY_ACTOR = "recovery"

# Postgres codes worth retrying the whole transaction for: serialization failure, deadlock, and a
# prepared statement the session lost (store.driver_sql prepares it again)
_RETRYABLE_SQLSTATES = {"40001", "40P01", driver_sql.INVALID_STATEMENT_NAME}


class CoordinatorBase:
    """The state every part shares, and the steps more than one part runs."""

    def __init__(
        self,
        engine: Engine,
        control_plane: KafkaControlPlane | None,
        clock: Clock | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.engine = engine
        self.connections = ConnectionShelf.of(engine)
        self.control_plane = control_plane
        self.clock = clock or DatabaseClock(engine)
        self.limits = limits or Limits()
        rules.validate_quarantine(
            self.limits.transactional_id_quarantine_ms, self.limits.lease_max_init_age_ms,
            self.limits.producer_init_timeout_ms, self.limits.producer_request_timeout_ms,
        )
        self._kafka_pool = ThreadPoolExecutor(max_workers=self.limits.kafka_parallelism, thread_name_prefix="kafka-control")

    def close(self) -> None:
        self._kafka_pool.shutdown(wait=True)
        self.connections.clear()
        if self.control_plane is not None:
            self.control_plane.close()

    # --- transactions ------------------------------------------------------------------------

    def _tx(self, fn: Callable[[Connection], T]) -> T:
        """Run fn in one database transaction, retrying it whole on deadlock, serialization failure
        or a dead pooled connection (safe: fn has no effect outside the transaction)."""
        for attempt in range(5):
            try:
                with self.connections.transaction() as conn:
                    return fn(conn)
            except DBAPIError as exc:
                code = getattr(exc.orig, "sqlstate", None)
                if (code not in _RETRYABLE_SQLSTATES and not exc.connection_invalidated) or attempt == 4:
                    raise
                log.info("retrying transaction after %s", code or "a lost database connection")
        raise AssertionError("unreachable")

    # --- finishing a decided commit (commit, resume, begin and recovery) ----------------------

    def _aborting_leases(self, checkpoint_ids: Sequence[int], conn: Connection | None = None) -> list[Lease]:
        """Leases of these checkpoints whose transactions are still to abort on Kafka."""
        if not checkpoint_ids:
            return []
        if conn is None:
            with self.engine.connect() as own:
                return self._aborting_leases(checkpoint_ids, own)
        return repo.leases_where(
            conn,
            unresolved_leases.c.checkpoint_id.in_(list(checkpoint_ids)),
            repo.unresolved_in(*ABORT_PENDING_STATES),
            source=unresolved_leases,
        )

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

    def _finish_commit(self, name: str, checkpoint_id: int, by: str) -> CommitResult | None:
        """Finish a decided commit found in the record (None if it was already finished). `by`
        names who found it unfinished (recovery_loop, resume, begin, commit_retry): marking it
        committed here records a checkpoint_committed event (actor recovery) saying so."""
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
        return self._commit_winners(_Decision(sink, cp, attempt, pending), finished_by=by)

    def _commit_winners(self, decision: _Decision, finished_by: str | None = None) -> CommitResult:
        """Commit every decided winner on Kafka by resume, then mark the checkpoint COMMITTED.
        Safe to run concurrently with itself (driver resume and recovery loop): every write is a CAS.
        The commit call that decided (finished_by None) writes no event for the mark: its
        commit_decided event and the checkpoint row are the record (one event per batch); a
        finish after the fact (finished_by set) records checkpoint_committed, actor recovery."""
        sink, cp, attempt, pending = decision.sink, decision.checkpoint, decision.attempt, decision.winners
        started = time.monotonic()
        if pending and self.control_plane is None:
            raise e.Unavailable(e.NO_CONTROL_PLANE, "no Kafka control plane configured to finish the commit")
        target = _target(sink)
        txns = []
        for lease in pending:
            assert lease.producer_id is not None and lease.producer_epoch is not None
            txns.append(PreparedTransaction(lease.transactional_id, lease.producer_id, lease.producer_epoch))
        outcomes = []
        if txns:
            assert self.control_plane is not None  # refused above
            outcomes = kafka_passes.commit_pass(self._kafka_pool, self.limits.kafka_parallelism, self.control_plane,
                                                target, txns)

        failures = {}
        not_tried: set[str] = set()  # of the failures: calls not made (Reach)
        refused: dict[str, rules.RefusedCommit] = {}  # refused for good: the data is lost
        after_all: dict[str, str] = {}  # refused, yet the log shows the transaction committed
        for lease, called in zip(pending, outcomes):
            error = called.error
            if error is None:
                continue
            if not error.transaction_gone:  # may still commit: stays COMMITTING, retried with backoff
                failures[lease.transactional_id] = str(error)
                if error.code == NOT_TRIED:
                    not_tried.add(lease.transactional_id)
                if not error.retriable:
                    log.error("commit of %s (batch %s of sink %s) answered %s: not a refusal that ends a "
                              "transaction, so it stays decided and is retried; check the coordinator's ACLs "
                              "and the broker's logs", lease.transactional_id, cp.batch_id, sink.name, error.code)
                continue
            outcome = self._log_outcome(target, lease)
            if outcome is TransactionOutcome.COMMITTED:  # e.g. EndTxn applied, its answer lost, id re-initialised
                after_all[lease.transactional_id] = error.code
            elif outcome is TransactionOutcome.ABORTED or not _first_offsets(lease):
                failures[lease.transactional_id] = str(error)
                refused[lease.transactional_id] = rules.RefusedCommit(
                    lease, error.code, str(error), confirmed=outcome is TransactionOutcome.ABORTED)
            else:  # the log cannot tell yet (abort markers still being written): ask again later
                failures[lease.transactional_id] = f"{error}; the partition log does not show the outcome yet"
        newly_lost: list[Lease] = []
        outcome: dict[str, Any] = {}
        committed_detail = dict(batch_id=cp.batch_id, attempt=attempt.number, by=finished_by)

        def record_all_committed(conn: Connection) -> CommitResult | None:
            """record() when Kafka committed every pending winner: the same writes in one round
            trip. The checkpoint found COMMITTED (another finisher marked it) is answered after
            this transaction, which the mark commits (outcome["leases"])."""
            outcome.clear()
            mark = hot_path.mark_committed(  # checks its answer against that rule
                conn, sink_id=sink.id, checkpoint_id=cp.id, attempt_id=attempt.id, done=pending,
                now=given_now(self.clock, conn), event_actor=RECOVERY_ACTOR if finished_by else None,
                event_detail=committed_detail,
            )
            outcome["checkpoint"] = mark.checkpoint
            if mark.marked is not None:
                outcome["committed_now"] = True
                return self._result_from(sink, *mark.marked, mark.leases)
            if mark.checkpoint.state is CheckpointState.COMMITTED:
                outcome["leases"] = mark.leases
            return None

        def record_first_tries_committed(conn: Connection) -> CommitResult | None:
            """record_all_committed for the commit call's own decision of first tries on the row
            (the common path), with no read of the row; None (nothing changed) when the checkpoint
            is not as that decision left it."""
            assert decision.unused_first_tries is not None
            mark = hot_path.mark_first_tries_committed(
                conn, checkpoint_id=cp.id, attempt_id=attempt.id, done=pending, unused=decision.unused_first_tries,
                now=given_now(self.clock, conn),
            )
            if mark is None or mark.marked is None:
                return None
            outcome["checkpoint"], outcome["committed_now"] = mark.checkpoint, True
            return self._result_from(sink, *mark.marked, mark.leases)

        def record(conn: Connection) -> CommitResult | None:
            newly_lost.clear()
            outcome.clear()
            now = self.clock.now_in(conn)
            if refused:  # lock order: sink before checkpoint (the halt is written on the sink)
                repo.sink_by_name(conn, sink.name, lock="update")
            locked = repo.as_checkpoint(  # lock order: checkpoint before its leases
                conn.execute(select(checkpoints).where(checkpoints.c.id == cp.id).with_for_update()).one()
            )
            repo.materialize_first_tries(conn, [attempt.id])  # their states now differ: lease rows
            done = [x.id for x in pending if x.transactional_id not in failures]
            changed = repo.cas(conn, lease_rows, done, [LeaseState.COMMITTING], LeaseState.COMMITTED, resolved_at=now)
            repo.release_transactional_ids(conn, done, now)  # a committed winner's id: reusable at once
            found_committed = [r.transactional_id for r in changed if r.transactional_id in after_all]
            if found_committed:
                repo.add_event(conn, sink.id, "committed_after_all", "coordinator", now, cp.id, batch_id=cp.batch_id,
                               transactional_ids=found_committed, codes=[after_all[t] for t in found_committed])
            # refused winners: their ids are fenced on Kafka (LOST_ABORTING) before they are free
            lost_rows = repo.cas(
                conn, lease_rows, [r.lease.id for r in refused.values()], [LeaseState.COMMITTING], LeaseState.LOST_ABORTING
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
                repo.add_event(conn, sink.id, "commit_failed", "coordinator", now, cp.id,
                               **failure_report(failures, not_tried))
                return None
            if locked.state is CheckpointState.LOST:
                return None
            final_cp, final_attempt = locked, attempt
            if locked.state is CheckpointState.COMMITTING and not still_committing:
                (a,) = repo.cas(conn, attempts, [attempt.id], [AttemptState.COMMITTING], AttemptState.COMMITTED, finished_at=now)
                (c,) = repo.cas(conn, checkpoints, [cp.id], [CheckpointState.COMMITTING], CheckpointState.COMMITTED, committed_at=now)
                final_cp, final_attempt = repo.as_checkpoint(c), repo.as_attempt(a)
                outcome["committed_now"] = True
                if finished_by:
                    repo.add_event(conn, sink.id, "checkpoint_committed", RECOVERY_ACTOR, now, cp.id,
                                   **committed_detail)
            elif locked.state is CheckpointState.COMMITTED:
                final_attempt = repo.attempt_by_id(conn, attempt.id)
            return self._result_from(sink, final_cp, final_attempt, checkpoint_leases)

        if refused or failures or after_all:
            result = self._tx(record)
        else:
            result = None
            if decision.unused_first_tries is not None and pending and finished_by is None:
                result = self._tx(record_first_tries_committed)
            if result is None:
                result = self._tx(record_all_committed)
        if "leases" in outcome:  # committed by another finisher: its attempt as that left it
            with self.engine.connect() as conn:
                result = self._result_from(sink, outcome["checkpoint"], repo.attempt_by_id(conn, attempt.id),
                                           outcome["leases"])
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
            report = failure_report(failures, not_tried)
            skipped = f" ({report['not_tried']} not tried: the broker answered none of this pass's calls)" \
                if "not_tried" in report else ""
            raise e.Unavailable(
                "kafka_commit_failed",
                f"the commit of batch {cp.batch_id} is decided but {len(failures)} transaction(s) could "
                f"not be committed on Kafka yet{skipped}; retry (resume) — the decision stands. Kafka: "
                + "; ".join(f"{tid}: {why}" for tid, why in sorted(report["failures"].items()))[:1000],
                **report,
            )
        return result

    def _log_outcome(self, target: KafkaTarget, lease: Lease) -> TransactionOutcome:
        """What a read_committed read at the lease's first offsets shows (UNKNOWN without them)."""
        assert self.control_plane is not None and lease.producer_id is not None and lease.producer_epoch is not None
        first = _first_offsets(lease)
        if not first:
            return TransactionOutcome.UNKNOWN
        txn = PreparedTransaction(lease.transactional_id, lease.producer_id, lease.producer_epoch)
        try:
            return self._off_loop(self.control_plane.transaction_outcome, target, txn, first)
        except ControlPlaneError as exc:
            log.warning("could not read the log of %s: %s", lease.transactional_id, exc)
            return TransactionOutcome.UNKNOWN

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

    # --- aborting on Kafka (every part) -------------------------------------------------------

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
        # read after claiming: a lease still ABORTING now cannot be released by anyone but us (a lease
        # to abort is a lease row: only those take the states that lead there)
        states = dict(guard.execute(
            select(lease_rows.c.id, lease_rows.c.state).where(lease_rows.c.id.in_([x.id for x in candidates]))
        ).all())
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

        outcomes = kafka_passes.abort_pass(self._kafka_pool, self.limits.kafka_parallelism, control_plane, target,
                                           [x.transactional_id for x in to_abort])
        for called in outcomes:
            if called.error is None or called.error.code != NOT_TRIED:  # a call made, whatever its outcome
                metrics.kafka_abort_finished(sink.name, called.seconds)
        errors = [called.error for called in outcomes]
        done = [x for x, err in zip(to_abort, errors) if err is None]
        failed = {x.transactional_id: str(err) for x, err in zip(to_abort, errors) if err is not None}
        not_tried = {x.transactional_id for x, err in zip(to_abort, errors) if err is not None and err.code == NOT_TRIED}

        def record(conn: Connection) -> None:
            now = self.clock.now_in(conn)
            changed = []
            for old, new in ABORT_PENDING_STATES.items():  # ABORTING -> ABORTED, LOST_ABORTING -> LOST
                changed += repo.cas(conn, lease_rows, [x.id for x in done if states[x.id] == old.value], [old], new,
                                    resolved_at=now)
            # an undecided try may still be alive and reach the broker: no reuse before the quarantine ends
            repo.release_transactional_ids(conn, [r.id for r in changed], now, now + self.limits.quarantine)
            if changed:
                repo.add_event(conn, sink.id, "transactions_aborted", "coordinator", now,
                               transactional_ids=[r.transactional_id for r in changed])
            if failed:
                repo.add_event(conn, sink.id, "abort_failed", "coordinator", now, **failure_report(failed, not_tried))

        self._tx(record)
        return AbortOutcome(aborted=[*already, *(x.transactional_id for x in done)], pending=[*elsewhere, *failed])

    def _parallel(self, fn: Callable[[Lease], T], items: Sequence[Lease],
                  stop: Callable[[T], T | None] = lambda _: None) -> list[T]:
        """kafka_passes.run_pass on the service's Kafka threads."""
        return kafka_passes.run_pass(self._kafka_pool, self.limits.kafka_parallelism, fn, items, stop)

    def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), which waits on Kafka: in a call running on the event loop, in a thread."""
        return kafka_passes.off_loop(self._kafka_pool, fn, *args)


def _first_offsets(lease: Lease) -> list[FirstOffset]:
    """The (topic, partition, offset) of the transaction's first record per partition, as the
    executor reports them with its pre-commit (absent on leases pre-committed without them)."""
    return [tuple(x) for x in json.loads(lease.first_offsets or "[]")]  # type: ignore[misc]


def _target(sink: Sink) -> KafkaTarget:
    return KafkaTarget(sink.name, sink.bootstrap_servers, sink.transaction_timeout_ms)
