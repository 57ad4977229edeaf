"""Ending transactions: an attempt's end in the database (its pre-leases freed, the leases tries
held marked for abort), and the aborts on Kafka that free their ids.

An abort by id fences whatever producer holds the id, so it must never reach Kafka after the id
was leased again. Every abort on Kafka therefore frees its id only after a quarantine longer than
any abort of it can still land (`rules.validate_quarantine` checks the settings at start-up): two
finishers aborting the same lease at once (a driver's retry and the recovery loop) is harmless.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import Connection

from ..kafka.control_plane import NOT_TRIED
from ..protocol.model import Attempt, Lease, Sink
from ..protocol.states import ABORT_PENDING_STATES, AttemptState, LeaseState
from ..store import batches, events, leases, pool
from . import metrics
from .context import ServiceContext, target
from .results import AbortOutcome


def end_attempts(conn: Connection, sink: Sink, attempts: Iterable[Attempt], reason: str, now: datetime,
                 actor: str) -> list[Lease]:
    """OPEN -> ABORTED for these (locked) attempts: their pre-leases no try claimed are freed at
    once (no producer ever used them), the leases tries hold are marked ABORTING. Returns those,
    whose transactions must now be aborted on Kafka; their ids stay held until that is done (I3)."""
    ended = batches.move_attempts(conn, [a.id for a in attempts], AttemptState.OPEN, AttemptState.ABORTED,
                                  finished_at=now, abort_reason=reason)
    to_abort: list[Lease] = []
    for a in ended:
        held = leases.of_attempt(conn, a.id, lock=True)
        leases.move(conn, [x.id for x in held if x.state is LeaseState.PRELEASED], [LeaseState.PRELEASED],
                    LeaseState.ABORTED, now)
        to_abort += leases.move(conn, [x.id for x in held if x.state is LeaseState.LEASED], [LeaseState.LEASED],
                                LeaseState.ABORTING, now)
        events.add(conn, sink.id, "attempt_aborted", actor, now, a.checkpoint_id, attempt=a.number, reason=reason)
    return to_abort


class Aborter:
    """Aborts leases' transactions on Kafka, then frees their ids after the quarantine."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def abort(self, sink: Sink, candidates: Sequence[Lease]) -> AbortOutcome:
        """Abort each lease still to abort (ABORTING, LOST_ABORTING); those another finisher ended
        meanwhile count as aborted."""
        if not candidates:
            return AbortOutcome()
        current = self.ctx.read(lambda conn: leases.by_ids(conn, sorted({x.id for x in candidates})))
        already = [x.transactional_id for x in current if x.state in ABORT_PENDING_STATES.values()]
        to_abort = [x for x in current if x.state in ABORT_PENDING_STATES]
        if not to_abort:
            return AbortOutcome(aborted=already)
        if self.ctx.control_plane is None:
            return AbortOutcome(aborted=already, pending=[x.transactional_id for x in to_abort])
        outcomes = self.ctx.control_plane.abort_all(target(sink), [x.transactional_id for x in to_abort],
                                                    self.ctx.limits.kafka_parallelism)
        for called in outcomes:
            if called.seconds:
                metrics.kafka_abort_finished(sink.name, called.seconds)
        done = [x for x, called in zip(to_abort, outcomes) if called.error is None]
        failed = {x.transactional_id: called.error for x, called in zip(to_abort, outcomes) if called.error is not None}

        def record(conn: Connection) -> list[Lease]:
            now = self.ctx.clock.now_in(conn)
            ended: list[Lease] = []
            for old, new in ABORT_PENDING_STATES.items():
                ended += leases.move(conn, [x.id for x in done if x.state is old], [old], new, now)
            pool.quarantine(conn, sink.id, [x.ordinal for x in ended], now + self.ctx.limits.quarantine)
            if ended:
                events.add(conn, sink.id, "transactions_aborted", "coordinator", now,
                           transactional_ids=[x.transactional_id for x in ended])
            if failed:
                events.add(conn, sink.id, "abort_failed", "coordinator", now,
                           **failure_report({t: str(err) for t, err in failed.items()},
                                            {t for t, err in failed.items() if err.code == NOT_TRIED}))
            return ended

        ended = self.ctx.transaction(record)
        return AbortOutcome(aborted=[*already, *(x.transactional_id for x in ended)], pending=sorted(failed))


def failure_report(failures: dict[str, str], not_tried: set[str]) -> dict[str, object]:
    """An event's or an answer's account of a pass's failed calls: each tried one's error by
    transactional id, and how many were not tried (still pending; a wide batch has thousands)."""
    report: dict[str, object] = {"failures": {t: why for t, why in failures.items() if t not in not_tried}}
    if left := len(not_tried & failures.keys()):
        report["not_tried"] = left
    return report
