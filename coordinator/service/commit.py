"""Commit (DESIGN.md §3 step 5), resume, and the driver's abort of an attempt.

Commit is one decision and then Kafka work:
1. decide, in one transaction: the sink (FOR SHARE), the checkpoint and the attempt (FOR UPDATE)
   and the attempt's leases (FOR UPDATE) read and locked, the clock read after the locks; the
   rules choose the winners and pass them through the timeout gate (I4); the winners' records are
   stored with the decision (COMMITTING), the leases tries held that did not win are marked for
   abort, the pre-leases no try claimed are freed, and the decision goes into the audit trail;
2. finish: every winner committed on Kafka by resume and the outcome recorded (committer.py);
3. the losers' transactions aborted on Kafka (they would block read_committed readers), whatever
   the winners' commit came to.
A retried commit finds the decision in the record (the same winners, or 409) and finishes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection

from ..protocol import errors as e
from ..protocol import rules
from ..protocol.model import Attempt, Checkpoint, Lease, PartitionResult, Sink
from ..protocol.states import ABORT_PENDING_STATES, WINNING_LEASE_STATES, AttemptState, CheckpointState, LeaseState
from ..store import batches, events, leases, sinks
from . import metrics
from .aborts import Aborter, end_attempts
from .committer import Committer, Decision
from .context import ServiceContext
from .results import AbortOutcome, CommitResult


@dataclass(frozen=True)
class _Decided:
    sink: Sink
    checkpoint: Checkpoint
    losers: list[Lease]  # leases tries held that did not win: to abort on Kafka
    decision: Decision | None  # this call's decision; None: a retry found one already made
    refusal: e.Conflict | None = None  # the timeout gate refused it: the attempt was aborted


def commit(ctx: ServiceContext, committer: Committer, aborter: Aborter, name: str, batch_id: int,
           attempt_number: int, generation: int, results: Sequence[PartitionResult], actor: str,
           job_ms: int | None = None) -> CommitResult:
    """Decide and finish the commit of an attempt. `job_ms` (the driver's write-job time) is stored
    on the attempt with the decision, for operators' throughput figures."""
    ctx.plane()  # no decision without a way to carry it out
    decided = ctx.transaction(lambda conn: _decide(ctx, conn, name, batch_id, attempt_number, generation, results,
                                                   actor, job_ms))
    if decided.refusal is not None:
        metrics.checkpoint_outcome(name, "deadline_refused")
        aborter.abort(decided.sink, decided.losers)
        raise decided.refusal
    recorded = None
    try:
        if decided.decision is not None:
            recorded = committer.finish_decision(decided.decision, by=None)
        else:
            committer.finish(name, decided.checkpoint.id, by="commit_retry")
    finally:
        # the losers do not depend on the winners: end their transactions (which would block
        # read_committed readers) even while the winners' commit waits for Kafka
        losers = decided.losers if decided.decision is not None else ctx.read(
            lambda conn: leases.of_checkpoints(conn, [decided.checkpoint.id], [LeaseState.ABORTING]))
        aborter.abort(decided.sink, losers)
    if recorded is not None and not decided.losers:  # nothing changed since the record: answer from it
        return _result(ctx, decided.sink, recorded.checkpoint, recorded.attempt, recorded.checkpoint_leases)
    return result_of(ctx, name, batch_id)


def _decide(ctx: ServiceContext, conn: Connection, name: str, batch_id: int, number: int, generation: int,
            results: Sequence[PartitionResult], actor: str, job_ms: int | None) -> _Decided:
    rows = batches.attempt_rows(conn, name, batch_id, number, lock="update")
    sink, cp, attempt = rows.sink, rows.checkpoint, rows.attempt
    rules.check_generation(sink.generation, generation)
    if cp.state is not CheckpointState.OPEN:
        if cp.committed_attempt != number:
            raise e.Conflict(e.COMMIT_DECIDED, f"batch {batch_id} was committed by attempt {cp.committed_attempt}",
                             committed_attempt=cp.committed_attempt)
        rules.check_same_winners(results, [x for x in leases.of_attempt(conn, attempt.id)
                                           if x.state in WINNING_LEASE_STATES])
        return _Decided(sink, cp, [], None)
    if attempt.state is AttemptState.ABORTED and attempt.abort_reason == e.DEADLINE_TOO_CLOSE:
        raise e.Conflict(e.DEADLINE_TOO_CLOSE, f"attempt {number} was aborted by the timeout gate")
    rules.check_attempt_writable(attempt, cp.current_attempt, generation)
    attempt_leases = leases.of_attempt(conn, attempt.id, lock=True)
    now = ctx.clock.now_in(conn)
    try:
        plan = rules.plan_commit(attempt_leases, results, ctx.limits.max_partitions, now=now,
                                 margin_ms=sink.commit_margin_ms)
    except e.Conflict as refusal:
        if refusal.reason != e.DEADLINE_TOO_CLOSE:
            raise
        to_abort = end_attempts(conn, sink, [attempt], e.DEADLINE_TOO_CLOSE, now, actor)
        events.add(conn, sink.id, "commit_refused", actor, now, cp.id, attempt=number, **refusal.to_dict())
        return _Decided(sink, cp, to_abort, None, refusal)
    winners = leases.decide_winners(conn, plan.winners)
    if len(winners) != len(plan.winners):
        raise AssertionError("a winner changed state under the decision's locks")
    losers = leases.move(conn, [x.id for x in plan.losers], [LeaseState.LEASED], LeaseState.ABORTING, now)
    leases.move(conn, [x.id for x in plan.unused], [LeaseState.PRELEASED], LeaseState.ABORTED, now)
    (attempt,) = batches.move_attempts(conn, [attempt.id], AttemptState.OPEN, AttemptState.COMMITTING,
                                       decided_at=now, partitions=len(results), job_ms=job_ms)
    cp = batches.move_checkpoint(conn, cp, CheckpointState.COMMITTING, decided_at=now, committed_attempt=number)
    events.add(conn, sink.id, "commit_decided", actor, now, cp.id, batch_id=batch_id, attempt=number,
               winners=sorted([w.partition, w.id] for w in winners))
    return _Decided(sink, cp, losers, Decision(sink, cp, attempt, winners, now))


def resume(ctx: ServiceContext, committer: Committer, aborter: Aborter, name: str, batch_id: int) -> CommitResult:
    """Finish a decided commit (after a crash); answers from the record if it is finished."""
    sink, cp = ctx.read(lambda conn: _sink_and_checkpoint(conn, name, batch_id))
    if cp.state is CheckpointState.OPEN:
        raise e.Conflict(e.NOT_COMMITTING, f"batch {batch_id} has no decided commit to resume")
    try:
        committer.finish(name, cp.id, by="resume")
    finally:
        aborter.abort(sink, ctx.read(lambda conn: leases.of_checkpoints(conn, [cp.id], [LeaseState.ABORTING])))
    return result_of(ctx, name, batch_id)


def result_of(ctx: ServiceContext, name: str, batch_id: int) -> CommitResult:
    """The answer to commit and resume, read from the record, so that a retry (on any replica)
    answers the same."""

    def read(conn: Connection) -> CommitResult:
        sink, cp = _sink_and_checkpoint(conn, name, batch_id)
        if cp.history_pruned_at is not None:
            raise e.Conflict(e.HISTORY_PRUNED, f"batch {batch_id} committed at {cp.committed_at}; its attempts, "
                             f"leases and events were pruned at {cp.history_pruned_at.isoformat()}, so there is "
                             "nothing to finish and no record to answer from", batch_id=batch_id)
        assert cp.committed_attempt is not None
        attempt = batches.attempt_of(conn, cp, cp.committed_attempt)
        return _result(ctx, sink, cp, attempt, leases.of_checkpoints(conn, [cp.id]))

    return ctx.read(read)


def _result(ctx: ServiceContext, sink: Sink, cp: Checkpoint, attempt: Attempt, checkpoint_leases: list[Lease]
            ) -> CommitResult:
    """The winners, and every transaction a try held that did not win, as aborted or still to abort."""
    winners = [x for x in checkpoint_leases if x.attempt_id == attempt.id
               and x.state in (LeaseState.COMMITTING, LeaseState.COMMITTED)]
    tried = [x for x in checkpoint_leases if x.task_attempt_id is not None]
    aborts = AbortOutcome(aborted=[x.transactional_id for x in tried if x.state is LeaseState.ABORTED],
                          pending=[x.transactional_id for x in tried if x.state in ABORT_PENDING_STATES])
    warnings = []
    if attempt.decided_at is not None:
        warning = rules.batch_duration_warning(attempt.started_at, attempt.decided_at, ctx.limits.restart_budget_ms,
                                               sink.transaction_timeout_ms)
        if warning:
            warnings.append(warning)
    return CommitResult(checkpoint=cp, attempt=attempt, winners=winners, aborts=aborts, warnings=warnings)


def _sink_and_checkpoint(conn: Connection, name: str, batch_id: int) -> tuple[Sink, Checkpoint]:
    sink = sinks.sink_by_name(conn, name)
    return sink, batches.checkpoint_for(conn, sink, batch_id)


def abort_attempt(ctx: ServiceContext, aborter: Aborter, name: str, batch_id: int, attempt_number: int,
                  generation: int | None, reason: str, actor: str) -> tuple[Attempt, AbortOutcome]:
    """Abort an undecided attempt (the driver gives up on it, or an operator does)."""

    def step(conn: Connection) -> tuple[Sink, list[Lease] | None]:
        sink = sinks.sink_by_name(conn, name, lock="share")
        if generation is not None:
            rules.check_generation(sink.generation, generation)
        cp = batches.checkpoint_for(conn, sink, batch_id, lock=True)
        attempt = batches.attempt_of(conn, cp, attempt_number, lock="update")
        if attempt.state is AttemptState.ABORTED:
            return sink, None  # a retry, or aborted earlier for another reason
        if attempt.state is not AttemptState.OPEN:
            raise e.Conflict(e.COMMIT_DECIDED, f"attempt {attempt_number} is {attempt.state}; it can no longer be aborted")
        return sink, end_attempts(conn, sink, [attempt], reason, ctx.clock.now_in(conn), actor)

    sink, to_abort = ctx.transaction(step)
    if to_abort is not None:
        metrics.checkpoint_outcome(name, "aborted")
    aborter.abort(sink, to_abort or [])

    def read(conn: Connection) -> tuple[Attempt, AbortOutcome]:
        cp = batches.checkpoint_for(conn, sink, batch_id)
        attempt = batches.attempt_of(conn, cp, attempt_number)
        tried = [x for x in leases.of_attempt(conn, attempt.id) if x.task_attempt_id is not None]
        return attempt, AbortOutcome(aborted=[x.transactional_id for x in tried if x.state is LeaseState.ABORTED],
                                     pending=[x.transactional_id for x in tried if x.state is LeaseState.ABORTING])

    return ctx.read(read)
