"""The recovery operations, run by the recovery loop (coordinator/service/recovery.py) so that nobody
needs to call back: finish decided commits, run pending aborts, abort expired leases, warn of
transactions near their timeout, sweep lingering transactions; and the operator's event trail."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Connection, cast, func, select
from sqlalchemy.dialects.postgresql import JSONPATH
from sqlalchemy.exc import DBAPIError

from ..kafka.control_plane import ControlPlaneError, KafkaTarget, OpenTransaction
from ..protocol import errors as e
from ..protocol import recovery_rules, rules
from ..protocol.model import Lease, Sink
from ..protocol.states import ABORT_PENDING_STATES, UNDECIDED_LEASE_STATES, AttemptState, CheckpointState, LeaseState
from ..store import repo
from ..store.tables import attempts, checkpoints, events, lease_rows, transactional_ids, unresolved_leases
from . import metrics
from .base import _target, log
from .reads import Reads
from .results import AbortOutcome, FinishOutcome, SweepOutcome

NAMED_IN_LOG = 5  # transactions a warning names; a wide batch past the threshold has thousands


class RecoveryOperations(Reads):
    """What the recovery loop runs (on Reads: the sweep asks get_sink and
    possibly_open_transactions)."""

    # --- recovery (driven by coordinator/service/recovery.py) ------------------------------------------

    def run_pending_aborts(self, name: str) -> AbortOutcome:
        """Abort on Kafka every transaction the database marks ABORTING (recovery loop's job)."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            pending = repo.leases_where(
                conn, unresolved_leases.c.sink_id == sink.id, repo.unresolved_in(*ABORT_PENDING_STATES),
                source=unresolved_leases,
            )
        return self._abort_on_kafka(name, pending)

    def finish_decided_commits(self, name: str, grace_ms: int = 0) -> FinishOutcome:
        """Finish every decided commit of the sink (COMMITTING checkpoints, and winners of LOST
        ones still to commit), then end their losers' transactions. Nobody needs to call back.
        `grace_ms`: leave the commits decided more recently than that to the calls deciding them
        (recovery_rules.checkpoints_to_finish)."""
        with self.engine.connect() as conn:
            now = self.clock.now_in(conn) if grace_ms > 0 else None  # the clock only for a grace
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
                conn, unresolved_leases.c.sink_id == sink.id, repo.unresolved_in(LeaseState.COMMITTING),
                source=unresolved_leases,
            ) if candidates else []
        by_id = {c.id: c for c in candidates}
        out = FinishOutcome()
        for cp_id in recovery_rules.checkpoints_to_finish(candidates, committing, now, grace_ms):
            batch = by_id[cp_id].batch_id
            try:
                try:
                    self._finish_commit(name, cp_id, "recovery_loop")
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
                attempts.c.sink_id == sink.id, attempts.c.state == AttemptState.OPEN.value,
                attempts.c.finished_at.is_(None),  # the partial index ix_attempts_open
            )
            candidates = repo.leases_where(
                conn,
                unresolved_leases.c.sink_id == sink.id,
                repo.unresolved_in(*UNDECIDED_LEASE_STATES),
                unresolved_leases.c.attempt_id.in_(open_attempts),
                source=unresolved_leases,
            )
            attempt_rows = [repo.attempt_by_id(conn, a) for a in {x.attempt_id for x in candidates}]
            now = self.clock.now_in(conn)
            expired = recovery_rules.expired_leases(candidates, attempt_rows, now, sink.commit_margin_ms)
            if not expired:
                return []
            # lock order: attempts, then leases by id (as commit does); the CAS re-checks state and the
            # open attempt
            repo.materialize_first_tries(conn, [x.attempt_id for x in expired])
            repo.leases_where(conn, lease_rows.c.id.in_([x.id for x in expired]), source=lease_rows, lock=True)
            changed = repo.cas(
                conn, lease_rows, [x.id for x in expired], UNDECIDED_LEASE_STATES, LeaseState.ABORTING,
                where=[lease_rows.c.attempt_id.in_(open_attempts)],
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
        (all of them, those warned about for the first time). The newly warned of each batch are
        one `transaction_near_timeout` event, which lists them: a wide batch stuck behind a down
        broker crosses the threshold thousands at once, and a row each would bury the batch's trail."""

        def step(conn: Connection) -> tuple[list[Lease], list[Lease]]:
            sink = repo.sink_by_name(conn, name)
            live = repo.leases_where(
                conn,
                unresolved_leases.c.sink_id == sink.id,
                repo.unresolved_in(*recovery_rules.NEAR_TIMEOUT_STATES),
                source=unresolved_leases,
            )
            now = self.clock.now_in(conn)
            near = recovery_rules.near_timeout(live, now, sink.transaction_timeout_ms, fraction)
            if not near:
                return [], []
            warned = _warned_lease_ids(conn, sink.id, {x.checkpoint_id for x in near})
            new = [x for x in near if x.id not in warned]
            by_checkpoint: dict[int, list[Lease]] = {}
            for x in new:
                by_checkpoint.setdefault(x.checkpoint_id, []).append(x)
            for checkpoint_id, batch in by_checkpoint.items():
                repo.add_event(
                    conn, sink.id, "transaction_near_timeout", "recovery", now, checkpoint_id,
                    fraction=fraction, count=len(batch),
                    leases=[[x.id, x.partition, x.transactional_id, str(x.state),
                             round(rules.transaction_age_fraction(x, now, sink.transaction_timeout_ms), 3),
                             rules.remaining_ms(x, now)] for x in batch],
                )
            return near, new

        near, new = self._tx(step)
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
        open_now = self.control_plane.list_open_transactions(target, rules.transactional_id_stem(sink.transactional_id_prefix))
        if not open_now:
            return SweepOutcome()
        # read after listing: a transaction open at listing time was leased before it (a lease is
        # durable before its producer exists), so an id free now had its lease resolved since
        unresolved = self.possibly_open_transactions(name)
        found = recovery_rules.lingering(open_now, unresolved)
        if not found:
            return SweepOutcome()
        metrics.LINGERING_FOUND.labels(name).inc(len(found))
        self._tx(lambda conn: repo.add_event(
            conn, sink.id, "lingering_transactions_found", "recovery", self.clock.now_in(conn),
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
                    repo.add_event(conn, sink.id, "lingering_abort_failed", "recovery", self.clock.now_in(conn),
                                   transactional_id=tid, error=str(exc))
                    return str(exc) or exc.code
                repo.add_event(conn, sink.id, "lingering_transaction_aborted", "recovery", self.clock.now_in(conn),
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
            repo.add_event(conn, sink.id, kind, actor, self.clock.now_in(conn), cp_id, **detail)

        self._tx(step)


def _warned_lease_ids(conn: Connection, sink_id: int, checkpoint_ids: set[int]) -> set[int]:
    """The leases of these checkpoints already warned about: each event lists its leases
    (`leases`, [lease id, ...] each); an event written before that names one (`lease_id`)."""
    of_these = (events.c.sink_id == sink_id, events.c.kind == "transaction_near_timeout",
                events.c.checkpoint_id.in_(sorted(checkpoint_ids)))
    first_of_each = cast("$.leases[*][0]", JSONPATH)
    listed = select(cast(func.jsonb_path_query(events.c.detail, first_of_each), BigInteger)).where(*of_these)
    named = select(cast(events.c.detail["lease_id"].astext, BigInteger)).where(*of_these, events.c.detail.has_key("lease_id"))
    return set(conn.execute(listed.union_all(named)).scalars())
