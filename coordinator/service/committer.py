"""Finishing a decided commit: every winner still COMMITTING committed on Kafka by resume (EndTxn
with its transactional id, producer id and epoch), each outcome judged by the one ladder
(commit_outcomes.py), then recorded in one transaction: winners COMMITTED, the checkpoint
COMMITTED once none is left; or, for a winner Kafka refused for good, the checkpoint LOST, the
sink halted and the loss in the audit trail.

The deciding call, a driver's resume or begin, and the recovery loop all finish through here, even
at once: every write is a compare-and-set and EndTxn of a committed transaction is answered as a
success, so a second finisher changes nothing."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection

from ..kafka.control_plane import ControlPlaneError, PreparedTransaction, TransactionOutcome
from ..protocol import errors as e
from ..protocol import rules
from ..protocol.model import Attempt, Checkpoint, Lease, Sink
from ..protocol.states import AttemptState, CheckpointState, LeaseState
from ..store import batches, events, leases, sinks
from . import metrics
from .aborts import Aborter, failure_report
from .commit_outcomes import CommitVerdict, Verdict, first_offsets, judge
from .context import ServiceContext, log, target

# the actor of a checkpoint_committed event: a decided commit finished after its commit call
RECOVERY_ACTOR = "recovery"


@dataclass(frozen=True)
class Decision:
    """A decided commit as the record holds it, with its winners still to commit on Kafka."""

    sink: Sink
    checkpoint: Checkpoint
    attempt: Attempt
    pending: list[Lease]
    now: datetime  # the database's time it was read at


@dataclass(frozen=True)
class Recorded:
    checkpoint: Checkpoint
    attempt: Attempt
    checkpoint_leases: list[Lease]
    committed_now: bool  # this finisher moved the checkpoint to COMMITTED
    newly_lost: list[Lease]
    became_lost: bool  # this finisher moved the checkpoint to LOST
    still_pending: dict[str, CommitVerdict]  # winners still COMMITTING, by transactional id


class Committer:
    def __init__(self, ctx: ServiceContext, aborter: Aborter) -> None:
        self.ctx = ctx
        self.aborter = aborter

    def finish(self, name: str, checkpoint_id: int, *, by: str | None) -> Recorded | None:
        """Commit every winner still to commit and record the outcome (None: the commit was
        already finished). `by`: who finished it after the call that decided it (recovery_loop,
        resume, begin, commit_retry), recorded as a checkpoint_committed event; None for the
        deciding call itself. Raises data_lost when a winner was refused for good, 503
        kafka_commit_failed while some may still commit."""
        decision = self.ctx.read(lambda conn: _decision(self.ctx, conn, name, checkpoint_id))
        return None if decision is None else self.finish_decision(decision, by=by)

    def finish_decision(self, decision: Decision, *, by: str | None) -> Recorded:
        """`finish` of a decision in hand (the deciding call's own)."""
        started = time.monotonic()
        verdicts = self._commit_on_kafka(decision)
        recorded = self.ctx.transaction(lambda conn: self._record(conn, decision, verdicts, by))
        self._report(decision, recorded, started)
        if recorded.checkpoint.state is CheckpointState.LOST:
            # fence the refused winners' ids before they can be leased again (I3)
            self.aborter.abort(decision.sink, [x for x in recorded.checkpoint_leases
                                               if x.state is LeaseState.LOST_ABORTING])
            raise rules.data_lost(recorded.checkpoint)
        if recorded.still_pending:
            raise _commit_failed(recorded.checkpoint, recorded.still_pending)
        return recorded

    def _commit_on_kafka(self, d: Decision) -> list[CommitVerdict]:
        if not d.pending:
            return []
        plane = self.ctx.plane()
        sink = target(d.sink)
        txns = [PreparedTransaction(x.transactional_id, x.producer_id, x.producer_epoch)  # type: ignore[arg-type]
                for x in d.pending]
        budget = self.ctx.commit_budget_ms(d.checkpoint.decided_at, d.now)
        outcomes = plane.commit_all(sink, txns, self.ctx.limits.kafka_parallelism, budget)

        def read_log(lease: Lease) -> TransactionOutcome:
            txn = PreparedTransaction(lease.transactional_id, lease.producer_id, lease.producer_epoch)  # type: ignore[arg-type]
            try:
                return plane.transaction_outcome(sink, txn, first_offsets(lease)) if first_offsets(lease) \
                    else TransactionOutcome.UNKNOWN
            except ControlPlaneError as exc:
                log.warning("could not read the log of %s: %s", lease.transactional_id, exc)
                return TransactionOutcome.UNKNOWN

        return [judge(lease, called.error, read_log) for lease, called in zip(d.pending, outcomes)]

    def _record(self, conn: Connection, d: Decision, verdicts: list[CommitVerdict], by: str | None) -> Recorded:
        now = self.ctx.clock.now_in(conn)
        by_verdict: dict[Verdict, list[CommitVerdict]] = {v: [] for v in Verdict}
        for v in verdicts:
            by_verdict[v.verdict].append(v)
        if by_verdict[Verdict.LOST]:  # lock order: the sink (its halt) before the checkpoint
            sinks.sink_by_name(conn, d.sink.name, lock="update", retired=True)
        cp = batches.checkpoint_by_id(conn, d.checkpoint.id, lock=True)
        done = [v.lease.id for v in (*by_verdict[Verdict.COMMITTED], *by_verdict[Verdict.COMMITTED_AFTER_ALL])]
        moved = leases.move(conn, done, [LeaseState.COMMITTING], LeaseState.COMMITTED, now)
        after_all = [v for v in by_verdict[Verdict.COMMITTED_AFTER_ALL] if v.lease.id in {x.id for x in moved}]
        if after_all:
            events.add(conn, d.sink.id, "committed_after_all", "coordinator", now, cp.id, batch_id=cp.batch_id,
                       transactional_ids=[v.lease.transactional_id for v in after_all],
                       codes=[v.code for v in after_all])
        lost = by_verdict[Verdict.LOST]
        newly_lost = leases.move(conn, [v.lease.id for v in lost], [LeaseState.COMMITTING], LeaseState.LOST_ABORTING, now)
        checkpoint_leases = leases.of_checkpoints(conn, [cp.id])
        still = {x.transactional_id for x in checkpoint_leases
                 if x.attempt_id == d.attempt.id and x.state is LeaseState.COMMITTING}
        pending = {v.lease.transactional_id: v for v in by_verdict[Verdict.PENDING] if v.lease.transactional_id in still}
        attempt: Attempt | None = None  # as this finisher moved it
        became_lost = committed_now = False
        if newly_lost:
            refused = [v for v in lost if v.lease.id in {x.id for x in newly_lost}]
            became_lost = cp.state is CheckpointState.COMMITTING
            cp, attempt = _record_loss(conn, d.sink, cp, d.attempt, refused, sorted(still), now)
        if pending:
            events.add(conn, d.sink.id, "commit_failed", "coordinator", now, cp.id,
                       **failure_report({t: v.message for t, v in pending.items()},
                                        {t for t, v in pending.items() if v.not_tried}))
        elif cp.state is CheckpointState.COMMITTING and not still:
            (attempt,) = batches.move_attempts(conn, [d.attempt.id], AttemptState.COMMITTING, AttemptState.COMMITTED,
                                               finished_at=now)
            cp = batches.move_checkpoint(conn, cp, CheckpointState.COMMITTED, committed_at=now)
            committed_now = True
            if by is not None:
                events.add(conn, d.sink.id, "checkpoint_committed", RECOVERY_ACTOR, now, cp.id,
                           batch_id=cp.batch_id, attempt=attempt.number, by=by)
        if attempt is None:  # another finisher may have moved it
            attempt = batches.attempt_by_id(conn, d.attempt.id)
        return Recorded(cp, attempt, checkpoint_leases, committed_now, newly_lost, became_lost, pending)

    def _report(self, d: Decision, r: Recorded, started: float) -> None:
        """Metrics and logs, once the record is committed (its transaction may have been retried)."""
        metrics.commit_finished(d.sink.name, time.monotonic() - started if d.pending else None,
                                committed=r.committed_now, lost=r.became_lost)
        if r.newly_lost:
            metrics.TRANSACTIONS_LOST.labels(d.sink.name).inc(len(r.newly_lost))
            if r.became_lost:
                metrics.CHECKPOINTS_LOST.labels(d.sink.name).inc()
            log.error("DATA LOST on sink %s: %s (sink halted until an operator acknowledges)", d.sink.name,
                      r.checkpoint.lost_reason)


def _decision(ctx: ServiceContext, conn: Connection, name: str, checkpoint_id: int) -> Decision | None:
    sink = sinks.sink_by_name(conn, name, retired=True)
    cp = batches.checkpoint_by_id(conn, checkpoint_id)
    if cp.state is CheckpointState.COMMITTED:
        return None
    if cp.committed_attempt is None:
        raise e.Conflict(e.NOT_COMMITTING, f"batch {cp.batch_id} has no decided commit to finish")
    attempt = batches.attempt_of(conn, cp, cp.committed_attempt)
    pending = [x for x in leases.of_attempt(conn, attempt.id) if x.state is LeaseState.COMMITTING]
    return Decision(sink, cp, attempt, pending, ctx.clock.now_in(conn))


def _record_loss(conn: Connection, sink: Sink, cp: Checkpoint, attempt: Attempt, refused: list[CommitVerdict],
                 still_committing: list[str], now: datetime) -> tuple[Checkpoint, Attempt | None]:
    """Kafka refused decided winners for good: the checkpoint and its attempt become LOST (the
    attempt is returned if this call moved it), the sink is halted, and the alert goes into the
    audit trail."""
    reason = rules.lost_reason(cp.batch_id, [rules.RefusedCommit(v.lease, v.code or "", v.message, v.confirmed)
                                             for v in refused])
    moved = None
    if cp.state is CheckpointState.COMMITTING:
        cp = batches.move_checkpoint(conn, cp, CheckpointState.LOST, lost_reason=reason, lost_at=now)
        (moved,) = batches.move_attempts(conn, [attempt.id], AttemptState.COMMITTING, AttemptState.LOST,
                                         finished_at=now)
    sinks.halt(conn, sink.id, reason, now)
    events.add(
        conn, sink.id, "data_lost", "coordinator", now, cp.id,
        batch_id=cp.batch_id, attempt=attempt.number, reason=reason,
        lost=[dict(partition=v.lease.partition, lease_id=v.lease.id, transactional_id=v.lease.transactional_id,
                   producer_id=v.lease.producer_id, producer_epoch=v.lease.producer_epoch, records=v.lease.records,
                   code=v.code, message=v.message[:500]) for v in refused],
        still_committing=still_committing,
    )
    return cp, moved


def _commit_failed(cp: Checkpoint, pending: dict[str, CommitVerdict]) -> e.Unavailable:
    report = failure_report({t: v.message for t, v in pending.items()}, {t for t, v in pending.items() if v.not_tried})
    skipped = f" ({report['not_tried']} not tried: the broker answered none of this pass's calls)" \
        if "not_tried" in report else ""
    failures: dict[str, str] = report["failures"]  # type: ignore[assignment]
    return e.Unavailable(
        "kafka_commit_failed",
        f"the commit of batch {cp.batch_id} is decided but {len(pending)} transaction(s) could not be committed on "
        f"Kafka yet{skipped}; retry (resume) — the decision stands. Kafka: "
        + "; ".join(f"{tid}: {why}" for tid, why in sorted(failures.items()))[:1000],
        **report,
    )
