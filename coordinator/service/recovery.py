"""The recovery loop (DESIGN.md §3 step 6): exactly one leader among the service's replicas
finishes decided commits even if Spark never comes back, aborts what must be aborted, sweeps the
broker for lingering transactions and warns before pre-committed transactions time out; with a
history retention set, it also prunes old committed batches' history (service/history.py).

Leadership is a lease row with a fencing token (`recovery_leader`): one UPDATE takes the row when
its lease has expired, or renews it for its holder, comparing with the *database's* clock
(`now()`), so the replicas' clocks do not matter. The token grows whenever the holder changes;
the leader renews at the start of each iteration, and again before a sink it has work for once a
quarter of the TTL has passed since, and stops its iteration as soon as it no longer holds the
lease. Exclusivity is about not doing the work N times (and not raising every alert N times):
correctness does not depend on it, because every change the loop makes is a compare-and-set,
safe against the API doing the same work concurrently (a driver's resume, another replica).

The decisions (what to finish, what has expired, what lingers, what to warn about) are pure
functions in coordinator/protocol/recovery_rules.py; the I/O is in Coordinator's recovery methods.
Each step of each sink backs off on its own (exponential, capped) when it fails, so a broker
that cannot list transactions does not stop decided commits from being finished. The loop runs
in a daemon thread, never on the API's event loop; `run_once()` is one iteration, for tests.
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, exists, literal, or_, select, text, true

from ..kafka.control_plane import ControlPlaneError
from ..protocol import recovery_rules
from ..protocol.states import ABORT_PENDING_STATES, UNDECIDED_LEASE_STATES, AttemptState, CheckpointState, LeaseState
from ..store import repo
from ..store.tables import attempts, checkpoints, sinks, unresolved_leases
from . import Coordinator, metrics
from .broker_checks import record_lso_lag

log = logging.getLogger(__name__)

LEADERSHIP = "recovery"
STEPS = ("finish", "pending_aborts", "expired_leases", "near_timeout", "sweep")
# the retention's pruning: batches per transaction, and how often once the backlog is gone
PRUNE_CHUNK = 500
PRUNE_EVERY_S = 600

_ACQUIRE = text(
    """
    UPDATE recovery_leader
       SET token = CASE WHEN holder IS NOT DISTINCT FROM :me THEN token ELSE token + 1 END,
           acquired_at = CASE WHEN holder IS NOT DISTINCT FROM :me AND expires_at >= now()
                              THEN acquired_at ELSE now() END,
           holder = :me,
           expires_at = now() + :ttl_ms * interval '1 millisecond'
     WHERE name = :name AND (expires_at < now() OR holder = :me)
    RETURNING token
    """
)
_SEED = text(
    "INSERT INTO recovery_leader (name, holder, token, acquired_at, expires_at) "
    "VALUES (:name, :me, 1, now(), now() + :ttl_ms * interval '1 millisecond') "
    "ON CONFLICT (name) DO NOTHING RETURNING token"
)
_RELEASE = text(
    "UPDATE recovery_leader SET expires_at = now() - interval '1 millisecond' WHERE name = :name AND holder = :me"
)


# The database steps' idle check: one statement per iteration says, for every sink, which of them
# may have work. Each condition is a superset of what its step acts on (the step decides); the
# time conditions are widened by _SLACK so rounding never hides work. A sink with nothing to do
# costs nothing more; before, each idle sink cost ~10 statements in 5 transactions per iteration.
_SLACK = timedelta(seconds=1)
_MS = text("interval '1 millisecond'")


def _due_query(now: datetime, finish_grace_ms: int = 0) -> Any:
    leases, lease_in = unresolved_leases, repo.unresolved_in  # ix_lease_rows_unresolved and ix_attempts_open
    # as recovery_rules.checkpoints_to_finish: a commit decided within the grace is its decider's
    decided_before = literal(now - timedelta(milliseconds=finish_grace_ms))
    old_enough = true() if finish_grace_ms <= 0 else or_(
        checkpoints.c.decided_at.is_(None), checkpoints.c.decided_at <= decided_before)
    finish = or_(
        exists().where(checkpoints.c.sink_id == sinks.c.id, checkpoints.c.state == CheckpointState.COMMITTING.value,
                       old_enough),
        exists().where(leases.c.sink_id == sinks.c.id, lease_in(LeaseState.COMMITTING),  # winners of LOST ones
                       *([] if finish_grace_ms <= 0 else [checkpoints.c.id == leases.c.checkpoint_id, old_enough])),
    )
    pending_aborts = exists().where(leases.c.sink_id == sinks.c.id, lease_in(*ABORT_PENDING_STATES))
    expired_leases = exists().where(  # recovery_rules.expired_leases / rules.deadline_too_close
        leases.c.sink_id == sinks.c.id, lease_in(*UNDECIDED_LEASE_STATES),
        attempts.c.id == leases.c.attempt_id, attempts.c.state == AttemptState.OPEN.value,
        leases.c.deadline_at < literal(now + _SLACK) + sinks.c.commit_margin_ms * _MS,
    )
    near_timeout = exists().where(  # recovery_rules.near_timeout
        leases.c.sink_id == sinks.c.id, lease_in(LeaseState.PRECOMMITTED, LeaseState.COMMITTING),
        leases.c.leased_at <= literal(now + _SLACK)
        - sinks.c.transaction_timeout_ms * recovery_rules.WARN_FRACTION * _MS,
    )
    return select(
        sinks.c.name, sinks.c.halted_at.is_not(None).label("halted"), finish.label("finish"),
        pending_aborts.label("pending_aborts"), expired_leases.label("expired_leases"),
        near_timeout.label("near_timeout"),
    ).where(sinks.c.retired_at.is_(None)).order_by(sinks.c.name)


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaderLease:
    """The lease row of one leadership. `acquire()` takes or renews it and returns the fencing
    token, or None while another holder's lease is unexpired."""

    def __init__(self, engine: Engine, holder: str, ttl_ms: int, name: str = LEADERSHIP) -> None:
        self.engine = engine
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.name = name

    def acquire(self) -> int | None:
        params = {"me": self.holder, "ttl_ms": self.ttl_ms, "name": self.name}
        with self.engine.begin() as conn:
            token = conn.execute(_ACQUIRE, params).scalar()
            if token is None:  # the row may be missing (never migrated with a seed): create it
                token = conn.execute(_SEED, params).scalar()
        return token

    def release(self) -> None:
        """Give the lease up at once (graceful shutdown), so another replica need not wait the TTL."""
        with self.engine.begin() as conn:
            conn.execute(_RELEASE, {"me": self.holder, "name": self.name})

    def current(self) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                text("SELECT holder, token, acquired_at, expires_at, expires_at > now() AS live "
                     "FROM recovery_leader WHERE name = :name"),
                {"name": self.name},
            ).first()
        return dict(row._mapping) if row is not None else None


@dataclass
class SinkReport:
    name: str
    committed: list[int] = field(default_factory=list)  # batch ids whose decided commit was finished
    lost: list[int] = field(default_factory=list)  # batch ids found or made LOST
    commit_pending: dict[int, str] = field(default_factory=dict)
    expired: list[str] = field(default_factory=list)  # ids of expired leases marked for abort
    aborted: list[str] = field(default_factory=list)  # ids aborted on Kafka (pending + expired)
    abort_pending: list[str] = field(default_factory=list)
    near_timeout: list[str] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)
    lingering_found: list[str] = field(default_factory=list)
    lingering_aborted: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # step -> error
    skipped: list[str] = field(default_factory=list)  # steps skipped (backing off, or no control plane)


@dataclass
class IterationReport:
    leader: bool
    token: int | None = None
    sinks: dict[str, SinkReport] = field(default_factory=dict)
    lost_leadership: bool = False
    pruned: int = 0  # batches whose history the retention pruned

    @property
    def errors(self) -> dict[str, dict[str, str]]:
        return {n: r.errors for n, r in self.sinks.items() if r.errors}


def _without_figures(error: str) -> str:
    """An error's text without its numbers (durations, try counts): the same failure again."""
    return re.sub(r"\d+(\.\d+)?", "#", error)


@dataclass
class _Backoff:
    failures: int = 0
    until: float = 0.0
    error: str = ""  # the last failure, logged at warning only when it changes


class RecoveryLoop:
    def __init__(
        self,
        coordinator: Coordinator,
        *,
        interval_ms: int = 5_000,
        leader_ttl_ms: int = 15_000,
        holder: str | None = None,
        max_backoff_ms: int = 60_000,
        monotonic: Callable[[], float] = time.monotonic,
        finish_grace_ms: int = 0,
        history_retention: timedelta | None = None,
    ) -> None:
        """`finish_grace_ms`: a decided commit younger than this is left to the call that decided
        it (the service passes its commit reach's recovery_grace_ms; 0 finishes it at once).
        `history_retention`: prune the history of batches committed longer ago than this, a chunk
        per iteration while there is a backlog, then every PRUNE_EVERY_S; None keeps it all."""
        if leader_ttl_ms <= interval_ms:
            raise ValueError(
                f"the recovery leader TTL ({leader_ttl_ms} ms) must exceed the loop interval ({interval_ms} ms), "
                "or the leader's lease lapses between its renewals"
            )
        self.coordinator = coordinator
        self.interval_ms = interval_ms
        self.finish_grace_ms = finish_grace_ms
        self.history_retention = history_retention
        self._prune_at = float("-inf")  # monotonic time the next prune is due
        self.max_backoff_ms = max(max_backoff_ms, interval_ms)
        self.lease = LeaderLease(coordinator.engine, holder or default_holder(), leader_ttl_ms)
        self._monotonic = monotonic
        self._backoff: dict[tuple[str, str], _Backoff] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: int | None = None
        self._renewed_at = float("-inf")  # monotonic time of the last acquire that returned a token
        self._sinks_seen: set[str] = set()  # the live sinks of the last iteration
        self.iterations = 0

    @property
    def holder(self) -> str:
        return self.lease.holder

    @property
    def is_leader(self) -> bool:
        return self._token is not None

    # --- one iteration --------------------------------------------------------------------------

    def run_once(self, *, honor_backoff: bool = False) -> IterationReport:
        """Take or renew the leadership; as leader, do every step for every sink. A step that
        fails is recorded in the report (and, with honor_backoff, skipped until its backoff ends)."""
        token = self._acquire()
        if token is None:
            return IterationReport(leader=False)
        report = IterationReport(leader=True, token=token)
        metrics.RECOVERY_ITERATIONS.inc()
        self.iterations += 1
        has_kafka = self.coordinator.control_plane is not None
        sinks_due = self._sinks_due()
        self._forget_retired({name for name, _, _ in sinks_due})
        for name, halted, due in sinks_due:
            metrics.SINK_HALTED.labels(name).set(1 if halted else 0)
            # a step backing off runs as before (its backoff ends only by running it)
            due |= {step for step in STEPS if (name, step) in self._backoff}
            if has_kafka:
                due.add("sweep")  # the broker's open transactions: nothing in the database says
            if not due:  # nothing to do: no statement, no renewal
                metrics.TRANSACTIONS_NEAR_TIMEOUT.labels(name).set(0)
                report.sinks[name] = SinkReport(name)
                continue
            if self._renewal_due() and self._acquire() != token:  # stop at once if it was lost
                report.lost_leadership = True
                break
            report.sinks[name] = self._run_sink(name, honor_backoff, due)
        if self.history_retention is not None and not report.lost_leadership:
            report.pruned = self._prune()
        return report

    def _prune(self) -> int:
        """One chunk of the retention's pruning when it is due; the next at once while there is
        a backlog, else after PRUNE_EVERY_S (after a failure too)."""
        now = self._monotonic()
        if now < self._prune_at:
            return 0
        assert self.history_retention is not None
        try:
            outcome = self.coordinator.prune_history(self.history_retention, "recovery", limit=PRUNE_CHUNK)
        except Exception:
            metrics.RECOVERY_ERRORS.labels("prune").inc()
            log.warning("recovery loop: pruning the history failed; next try in %d s", PRUNE_EVERY_S, exc_info=True)
            self._prune_at = now + PRUNE_EVERY_S
            return 0
        self._prune_at = now if outcome.more else now + PRUNE_EVERY_S
        return outcome.pruned

    def _forget_retired(self, live: set[str]) -> None:
        """Drop the gauges and backoffs of sinks retired since the last iteration."""
        for retired in self._sinks_seen - live:
            metrics.forget_sink(retired)
            for step in STEPS:
                self._backoff.pop((retired, step), None)
        self._sinks_seen = live

    def _sinks_due(self) -> list[tuple[str, bool, set[str]]]:
        """Every live sink: its name, whether it is halted, and the database steps that may have work."""
        c = self.coordinator
        with c.engine.connect() as conn:
            rows = conn.execute(_due_query(c.clock.now_in(conn), self.finish_grace_ms)).all()
        return [(r.name, r.halted, {s for s in STEPS if s != "sweep" and getattr(r, s)}) for r in rows]

    def _renewal_due(self) -> bool:
        """Before a sink with work, the leadership is renewed if a quarter of its TTL has passed
        since the last renewal: the lease then has at least three quarters of the TTL left whenever
        a sink's steps start (no other replica can take it over before it expires), and a loop over
        many busy sinks does not update the leadership row once per sink."""
        return self._monotonic() - self._renewed_at >= self.lease.ttl_ms / 4000

    def _acquire(self) -> int | None:
        renewing_at = self._monotonic()
        token = self.lease.acquire()
        self._renewed_at = renewing_at if token is not None else float("-inf")
        if token != self._token:
            if token is None:
                log.warning("recovery loop: %s no longer leads (token %s)", self.holder, self._token)
            else:
                log.info("recovery loop: %s leads with fencing token %s", self.holder, token)
        self._token = token
        metrics.RECOVERY_LEADER.set(1 if token is not None else 0)
        return token

    def _run_sink(self, name: str, honor_backoff: bool, due: set[str] | None = None) -> SinkReport:
        r = SinkReport(name)
        c = self.coordinator
        has_kafka = c.control_plane is not None

        def finish() -> None:
            out = c.finish_decided_commits(name, self.finish_grace_ms)
            r.committed, r.lost, r.commit_pending = out.committed, out.lost, out.failed
            if out.committed:
                metrics.RECOVERED_COMMITS.labels(name).inc(len(out.committed))
            if out.failed:
                raise RuntimeError(f"decided commits still pending: {out.failed}")

        def pending_aborts() -> None:
            out = c.run_pending_aborts(name)
            r.aborted += out.aborted
            r.abort_pending += out.pending

        def expired_leases() -> None:
            expired, out = c.abort_expired_leases(name)
            r.expired = [x.transactional_id for x in expired]
            r.aborted += out.aborted
            r.abort_pending += out.pending

        def near_timeout() -> None:
            near, new = c.warn_near_timeout(name)
            r.near_timeout = [x.transactional_id for x in near]
            r.warned = [x.transactional_id for x in new]

        def sweep() -> None:
            try:
                out = c.sweep_lingering(name)
            except ControlPlaneError as exc:
                if not exc.retriable:  # e.g. no KIP-664: the broker still answers the lag observation
                    record_lso_lag(c, name)
                raise  # an unreachable broker: do not spend a second retry budget on the gauge
            record_lso_lag(c, name)  # the partitions' lag gauges (never raises)
            r.lingering_found = [t.transactional_id for t in out.found]
            r.lingering_aborted = out.aborted
            if out.failed:
                raise RuntimeError(f"lingering transactions not aborted: {out.failed}")

        steps = {"finish": finish, "pending_aborts": pending_aborts, "expired_leases": expired_leases,
                 "near_timeout": near_timeout, "sweep": sweep}
        for step in STEPS:
            if step == "sweep" and not has_kafka:
                r.skipped.append(step)
                continue
            if due is not None and step not in due:
                if step == "near_timeout":
                    metrics.TRANSACTIONS_NEAR_TIMEOUT.labels(name).set(0)
                continue
            key = (name, step)
            backoff = self._backoff.get(key)
            if honor_backoff and backoff is not None and self._monotonic() < backoff.until:
                r.skipped.append(step)
                continue
            try:
                steps[step]()
            except Exception as exc:  # noqa: BLE001 - one failing step must not stop the others
                r.errors[step] = f"{type(exc).__name__}: {exc}"
                metrics.RECOVERY_ERRORS.labels(step).inc()
                b = self._backoff.setdefault(key, _Backoff())
                b.failures += 1
                delay_ms = min(self.interval_ms * 2 ** b.failures, self.max_backoff_ms)
                b.until = self._monotonic() + delay_ms * random.uniform(0.8, 1.0) / 1000
                # once per change of state, not per try: a broker that stays down (or lacks a
                # feature, e.g. KIP-664) is said once, until the failure changes or the step recovers
                changed = _without_figures(r.errors[step]) != _without_figures(b.error)
                b.error = r.errors[step]
                log.log(logging.WARNING if changed else logging.DEBUG,
                        "recovery loop: step %s of sink %s failed (%d in a row; next try in %.1f s): %s",
                        step, name, b.failures, delay_ms / 1000, r.errors[step])
            else:
                failed = self._backoff.pop(key, None)
                if failed is not None:
                    log.info("recovery loop: step %s of sink %s succeeds again after %d failure(s)",
                             step, name, failed.failures)
        if r.lost:
            log.error("recovery loop: sink %s lost data in batches %s; it is halted until acknowledged", name, r.lost)
        return r

    # --- the thread -----------------------------------------------------------------------------

    def start(self) -> RecoveryLoop:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._run, name="recovery-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0, *, release: bool = True) -> None:
        """Stop the thread (it finishes its current step) and give the leadership up."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if release and self._token is not None:
            try:
                self.lease.release()
            except Exception:
                log.warning("recovery loop: could not release the leadership", exc_info=True)
            self._token = None
            metrics.RECOVERY_LEADER.set(0)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self.run_once(honor_backoff=True)
                failures = 0
                delay_ms = self.interval_ms
            except Exception:  # the database is unreachable, or a bug: back off, never die
                failures += 1
                metrics.RECOVERY_ERRORS.labels("iteration").inc()
                delay_ms = min(self.interval_ms * 2 ** failures, self.max_backoff_ms)
                log.exception("recovery loop iteration failed (%d in a row; next try in %.1f s)",
                              failures, delay_ms / 1000)
            self._stop.wait(delay_ms * random.uniform(0.9, 1.0) / 1000)
