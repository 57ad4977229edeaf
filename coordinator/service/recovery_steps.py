"""What the recovery loop (service/recovery.py) runs for one sink: finish its decided commits,
abort what is marked for abort, mark expired leases for abort, warn before transactions time
out, and sweep the broker for lingering transactions. Each step decides with the pure rules of
protocol/recovery_rules.py and changes state only by compare-and-set, so it is safe alongside the
API doing the same work (a driver's resume, another replica)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from ..kafka.control_plane import ControlPlaneError, OpenTransaction
from ..protocol import configuration as config
from ..protocol import errors as e
from ..protocol import recovery_rules, rules
from ..protocol.model import Lease, Sink
from ..protocol.states import ABORT_PENDING_STATES, UNDECIDED_LEASE_STATES, LeaseState
from ..store import batches, events, leases, pool, sinks
from . import metrics
from .aborts import Aborter
from .committer import Committer
from .context import ServiceContext, log, target
from .results import AbortOutcome, FinishOutcome, SweepOutcome

NAMED_IN_LOG = 5  # transactions a warning names; a wide batch past the threshold has thousands


class RecoverySteps:
    def __init__(self, ctx: ServiceContext, committer: Committer, aborter: Aborter) -> None:
        self.ctx = ctx
        self.committer = committer
        self.aborter = aborter

    def finish_decided_commits(self, name: str, grace_ms: int = 0) -> FinishOutcome:
        """Finish every decided commit of the sink (COMMITTING checkpoints, and winners of LOST
        ones still to commit), then end their losers' transactions. `grace_ms`: leave commits
        decided more recently than that to the calls deciding them."""

        def read(conn: Connection) -> tuple[Sink, list[int], dict[int, int]]:
            sink = sinks.sink_by_name(conn, name)
            decided = batches.decided_checkpoints(conn, sink.id)
            committing = leases.unresolved(conn, sink.id, [LeaseState.COMMITTING]) if decided else []
            todo = recovery_rules.checkpoints_to_finish(decided, committing, self.ctx.clock.now_in(conn), grace_ms)
            return sink, todo, {c.id: c.batch_id for c in decided}

        sink, todo, batch_of = self.ctx.read(read)
        out = FinishOutcome()
        for checkpoint_id in todo:
            batch = batch_of[checkpoint_id]
            try:
                try:
                    self.committer.finish(name, checkpoint_id, by="recovery_loop")
                finally:
                    self.aborter.abort(sink, self.ctx.read(
                        lambda conn: leases.of_checkpoints(conn, [checkpoint_id], [LeaseState.ABORTING])))
                out.committed.append(batch)
            except e.Conflict as exc:
                if exc.reason != e.DATA_LOST:
                    raise
                out.lost.append(batch)
            except (e.Unavailable, ControlPlaneError) as exc:
                out.failed[batch] = str(exc)
        if out.committed:
            metrics.RECOVERED_COMMITS.labels(name).inc(len(out.committed))
        return out

    def run_pending_aborts(self, name: str) -> AbortOutcome:
        """Abort on Kafka every transaction the database marks for abort."""
        sink, pending = self.ctx.read(lambda conn: _with_sink(conn, name, lambda s: leases.unresolved(
            conn, s.id, ABORT_PENDING_STATES)))
        return self.aborter.abort(sink, pending)

    def abort_expired_leases(self, name: str) -> tuple[list[Lease], AbortOutcome]:
        """Mark for abort the undecided leases whose transactions can no longer pass the commit
        gate (an executor died, or a driver vanished mid-batch), then abort them. Their ids stay
        held until the abort is done on Kafka (I3); pre-leases no try holds are freed at once."""

        def step(conn: Connection) -> tuple[Sink, list[Lease]]:
            sink = sinks.sink_by_name(conn, name)
            now = self.ctx.clock.now_in(conn)
            expired = recovery_rules.expired_leases(leases.unresolved(conn, sink.id, UNDECIDED_LEASE_STATES), now,
                                                    sink.commit_margin_ms)
            if not expired:
                return sink, []
            for attempt_id in sorted({x.attempt_id for x in expired}):  # lock order: attempts before leases
                batches.lock_attempt(conn, attempt_id)
            leases.move(conn, [x.id for x in expired if x.state is LeaseState.PRELEASED], [LeaseState.PRELEASED],
                        LeaseState.ABORTED, now)
            changed = leases.move(conn, [x.id for x in expired if x.state is LeaseState.LEASED], [LeaseState.LEASED],
                                  LeaseState.ABORTING, now)
            for cp_id in sorted({x.checkpoint_id for x in changed}):
                events.add(conn, sink.id, "expired_leases_aborted", "recovery", now, cp_id,
                           leases=[[x.id, x.partition, x.transactional_id, str(x.deadline_at)] for x in changed
                                   if x.checkpoint_id == cp_id])
            return sink, changed

        sink, expired = self.ctx.transaction(step)
        if expired:
            metrics.EXPIRED_LEASES_ABORTED.labels(name).inc(len(expired))
        return expired, self.aborter.abort(sink, expired)

    def warn_near_timeout(self, name: str, fraction: float = recovery_rules.WARN_FRACTION
                          ) -> tuple[list[Lease], list[Lease]]:
        """Transactions past `fraction` of their lifetime. Returns (all of them, those warned
        about for the first time); the newly warned of each batch are one event that lists them."""

        def step(conn: Connection) -> tuple[list[Lease], list[Lease]]:
            sink = sinks.sink_by_name(conn, name)
            now = self.ctx.clock.now_in(conn)
            near = recovery_rules.near_timeout(leases.unresolved(conn, sink.id, recovery_rules.NEAR_TIMEOUT_STATES),
                                               now, sink.transaction_timeout_ms, fraction)
            warned = events.warned_lease_ids(conn, sink.id, {x.checkpoint_id for x in near})
            new = [x for x in near if x.id not in warned]
            for checkpoint_id in sorted({x.checkpoint_id for x in new}):
                batch = [x for x in new if x.checkpoint_id == checkpoint_id]
                events.add(conn, sink.id, "transaction_near_timeout", "recovery", now, checkpoint_id,
                           fraction=fraction, count=len(batch),
                           leases=[[x.id, x.partition, x.transactional_id, str(x.state),
                                    round(rules.transaction_age_fraction(x, now, sink.transaction_timeout_ms), 3),
                                    rules.remaining_ms(x, now)] for x in batch])
            return near, new

        near, new = self.ctx.transaction(step)
        metrics.TRANSACTIONS_NEAR_TIMEOUT.labels(name).set(len(near))
        if new:
            metrics.TRANSACTION_TIMEOUT_WARNINGS.labels(name).inc(len(new))
            named = ", ".join(f"{x.transactional_id} (lease {x.id}, {x.state})" for x in new[:NAMED_IN_LOG])
            more = f" and {len(new) - NAMED_IN_LOG} more" if len(new) > NAMED_IN_LOG else ""
            log.warning("sink %s: %d transaction(s) newly past %d%% of their timeout: %s%s", name, len(new),
                        int(fraction * 100), named, more)
        return near, new

    def sweep_lingering(self, name: str) -> SweepOutcome:
        """Abort the open transactions under the sink's prefix that the database does not explain
        (DESIGN.md §3 step 6, I6): left by a lost lease record, an old deployment, or a producer
        that outlived its lease."""
        sink = self.ctx.read(lambda conn: sinks.sink_by_name(conn, name))
        open_now = self.ctx.plane().list_open_transactions(
            target(sink), config.transactional_id_stem(sink.transactional_id_prefix))
        return self.sweep_open_transactions(sink, open_now)

    def sweep_open_transactions(self, sink: Sink, open_now: list[OpenTransaction]) -> SweepOutcome:
        """The sweep of `sink` given what the broker listed under its prefix. Read after listing: a
        transaction open at listing time was leased before it (a lease is durable before its
        producer exists), so an id free now had its lease resolved since."""
        if not open_now:
            return SweepOutcome()
        found = recovery_rules.lingering(open_now, self.ctx.read(lambda conn: leases.unresolved(conn, sink.id)))
        if not found:
            return SweepOutcome()
        metrics.LINGERING_FOUND.labels(sink.name).inc(len(found))
        log.warning("sink %s: %d lingering transaction(s) the database does not explain: %s", sink.name, len(found),
                    [t.transactional_id for t in found])
        held = self.ctx.transaction(lambda conn: self._hold_for_abort(conn, sink, found))
        aborted: list[str] = []
        failed: dict[str, str] = {}
        plane = self.ctx.plane()
        outcomes = plane.abort_all(target(sink), [t.transactional_id for t in held], self.ctx.limits.kafka_parallelism)
        for t, called in zip(held, outcomes):
            if called.error is None:
                aborted.append(t.transactional_id)
            else:
                failed[t.transactional_id] = str(called.error)

        def record(conn: Connection) -> None:
            now = self.ctx.clock.now_in(conn)
            for t in held:
                if t.transactional_id in aborted:
                    events.add(conn, sink.id, "lingering_transaction_aborted", "recovery", now,
                               transactional_id=t.transactional_id, producer_id=t.producer_id,
                               producer_epoch=t.producer_epoch)
                else:
                    events.add(conn, sink.id, "lingering_abort_failed", "recovery", now,
                               transactional_id=t.transactional_id, error=failed[t.transactional_id])

        self.ctx.transaction(record)
        if aborted:
            metrics.LINGERING_ABORTED.labels(sink.name).inc(len(aborted))
        skipped = [t.transactional_id for t in found if t not in held]
        return SweepOutcome(found=found, aborted=aborted, skipped=skipped, failed=failed)

    def _hold_for_abort(self, conn: Connection, sink: Sink, found: list[OpenTransaction]) -> list[OpenTransaction]:
        """Quarantine the ids of the lingering transactions that no lease holds now (under the
        pool's lock, so no grant takes them meanwhile) for longer than their abort can take: the
        abort can then never fence a producer of a later lease. Those leased since are explained."""
        now = self.ctx.clock.now_in(conn)
        pool.lock(conn, sink.id)
        held_now = {x.transactional_id for x in leases.unresolved(conn, sink.id)}
        out = [t for t in found if t.transactional_id not in held_now]
        ordinals = [n for t in out if (n := config.ordinal_of(sink.transactional_id_prefix, t.transactional_id)) is not None]
        pool.quarantine(conn, sink.id, ordinals, now + self.ctx.limits.quarantine)
        events.add(conn, sink.id, "lingering_transactions_found", "recovery", now,
                   transactions=[dict(transactional_id=t.transactional_id, producer_id=t.producer_id,
                                      producer_epoch=t.producer_epoch, state=t.state, started_at_ms=t.started_at_ms,
                                      partitions=[list(p) for p in t.partitions]) for t in found])
        return out

    def record_operator_event(self, name: str, kind: str, actor: str, batch_id: int | None = None,
                              **detail: Any) -> None:
        """Put an operator's action into the sink's event trail (who in `actor`, when from the clock)."""

        def step(conn: Connection) -> None:
            sink = sinks.sink_by_name(conn, name)
            cp_id = batches.checkpoint_for(conn, sink, batch_id).id if batch_id is not None else None
            events.add(conn, sink.id, kind, actor, self.ctx.clock.now_in(conn), cp_id, **detail)

        self.ctx.transaction(step)


def _with_sink(conn: Connection, name: str, read: Any) -> Any:
    sink = sinks.sink_by_name(conn, name)
    return sink, read(sink)
