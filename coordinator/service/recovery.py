"""The recovery loop (DESIGN.md §3 step 6): exactly one leader among the service's replicas
finishes decided commits even if Spark never comes back, aborts what must be aborted, warns before
transactions time out and sweeps the brokers for lingering transactions; with a history retention
set, it also prunes old committed batches' history.

A pass, every interval:
1. take or renew the leadership (store/leadership.py: a lease row on the database's clock);
2. read what is due, in two statements whatever the number of sinks: the decided commits and the
   unresolved leases (the transactions that may be open); `recovery_rules.due_work` says which
   sink has which steps. An idle sink costs nothing;
3. hand each sink's work to a worker of its own: its decided commits first, on workers reserved
   for them, so no sink's commit ever waits behind another sink's Kafka calls (a cluster that does
   not answer costs its own sinks a retry budget, nobody else's); then its other steps. A sink
   whose previous work is still running is left to the next pass;
4. every `sweep_interval_ms`, per Kafka cluster: one ListTransactions, matched to the cluster's
   sinks by their prefixes, and what no lease explains aborted.
Each step of each sink backs off on its own (exponential, capped) when it fails. Correctness does
not depend on the leadership: every change is a compare-and-set, safe alongside the API doing the
same work (a driver's resume, another replica). The loop runs in a daemon thread, never on the
API's event loop; `run_once()` is one pass (waiting for its work), for tests.
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection

from ..kafka.control_plane import KafkaTarget
from ..protocol import recovery_rules
from ..protocol.recovery_rules import SinkTimes, Step
from ..protocol.configuration import transactional_id_stem
from ..protocol.model import Sink
from ..protocol.states import MAY_HOLD_TRANSACTION
from ..store import batches, leadership, leases, sinks
from . import Coordinator, metrics
from .broker_checks import record_lso_lag

log = logging.getLogger(__name__)

LEADERSHIP = "recovery"
SWEEP = "sweep"
# the retention's pruning: batches per transaction, and how often once the backlog is gone
PRUNE_CHUNK = 500
PRUNE_EVERY_S = 600


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaderLease:
    """The lease row of one leadership. `acquire()` takes or renews it and returns the fencing
    token, or None while another holder's lease is unexpired."""

    def __init__(self, coordinator: Coordinator, holder: str, ttl_ms: int, name: str = LEADERSHIP) -> None:
        self.ctx = coordinator.ctx
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.name = name

    def acquire(self) -> int | None:
        return self.ctx.transaction(lambda conn: leadership.acquire(conn, self.name, self.holder, self.ttl_ms))

    def release(self) -> None:
        """Give the lease up at once (graceful shutdown), so another replica need not wait the TTL."""
        self.ctx.transaction(lambda conn: leadership.release(conn, self.name, self.holder))

    def current(self) -> dict[str, Any] | None:
        return self.ctx.read(lambda conn: leadership.current(conn, self.name))


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
    skipped: list[str] = field(default_factory=list)  # steps skipped (backing off, or still running)


@dataclass
class IterationReport:
    leader: bool
    token: int | None = None
    sinks: dict[str, SinkReport] = field(default_factory=dict)
    pruned: int = 0  # batches whose history the retention pruned

    @property
    def errors(self) -> dict[str, dict[str, str]]:
        return {n: r.errors for n, r in self.sinks.items() if r.errors}


@dataclass
class _Backoff:
    failures: int = 0
    until: float = 0.0
    error: str = ""  # the last failure, logged at warning only when it changes


class RecoveryLoop:
    def __init__(self, coordinator: Coordinator, *, interval_ms: int = 5_000, leader_ttl_ms: int = 15_000,
                 holder: str | None = None, max_backoff_ms: int = 60_000, monotonic: Callable[[], float] = time.monotonic,
                 finish_grace_ms: int = 0, history_retention: timedelta | None = None,
                 sweep_interval_ms: int | None = 30_000,
                 workers: int = 8, finish_workers: int = 64,
                 pool: Callable[[int, str], Any] = lambda n, name: ThreadPoolExecutor(n, thread_name_prefix=name)) -> None:
        """`finish_grace_ms`: a decided commit younger than this is left to the call that decided
        it (the service passes its commit reach's recovery_grace_ms). `history_retention`: prune
        the history of batches committed longer ago than this; None keeps it all.
        `sweep_interval_ms`: how often each cluster is swept (None: never, for tests of the other steps).
        `pool(workers, name)`: makes the loop's two pools of workers (the simulation runs them in
        simulated time)."""
        if leader_ttl_ms <= interval_ms:
            raise ValueError(f"the recovery leader TTL ({leader_ttl_ms} ms) must exceed the loop interval "
                             f"({interval_ms} ms), or the leader's lease lapses between its renewals")
        self.coordinator = coordinator
        self.interval_ms = interval_ms
        self.finish_grace_ms = finish_grace_ms
        self.history_retention = history_retention
        self.sweep_interval_ms = sweep_interval_ms
        self.max_backoff_ms = max(max_backoff_ms, interval_ms)
        self.lease = LeaderLease(coordinator, holder or default_holder(), leader_ttl_ms)
        self._monotonic = monotonic
        self._backoff: dict[tuple[str, str], _Backoff] = {}
        self._finishers = pool(finish_workers, "recovery-finish")
        self._workers = pool(workers, "recovery-steps")
        self._running: dict[tuple[str, str], Future[list[SinkReport]]] = {}  # (sink or cluster, kind): in flight
        self._lock = threading.Lock()
        self._next_sweep = float("-inf")  # monotonic time the next sweep of every cluster is due
        self._warning: set[str] = set()  # sinks with transactions near their timeout at the last pass
        self._transacting: set[str] = set()  # sinks with a transaction in flight at the last pass
        self._prune_at = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: int | None = None
        self.iterations = 0

    @property
    def holder(self) -> str:
        return self.lease.holder

    @property
    def is_leader(self) -> bool:
        return self._token is not None

    # --- one pass ---------------------------------------------------------------------------------

    def run_once(self, *, honor_backoff: bool = False, wait: bool = True) -> IterationReport:
        """Take or renew the leadership; as leader, hand every sink's due work to its workers (and
        with `wait`, wait for it and report it). A failed step is in the report (and, with
        honor_backoff, skipped until its backoff ends)."""
        token = self._acquire()
        if token is None:
            return IterationReport(leader=False)
        report = IterationReport(leader=True, token=token)
        metrics.RECOVERY_ITERATIONS.inc()
        self.iterations += 1
        due, names, in_flight = self._due()
        warning = {names[k] for k, steps in due.steps.items() if Step.NEAR_TIMEOUT in steps and k in names}
        if left := self._warning - warning:  # nothing near its timeout any more, or retired meanwhile
            live = {s.name for s in self.coordinator.list_sinks()}
            for name in left:
                if name in live:
                    metrics.TRANSACTIONS_NEAR_TIMEOUT.labels(name).set(0)
                else:
                    metrics.forget_sink(name)
        self._warning = warning
        started: list[Future[list[SinkReport]]] = []
        for sink_id, steps in sorted(due.steps.items(), key=lambda kv: names.get(kv[0], "")):
            name = names.get(sink_id)
            if name is None:
                continue
            if Step.FINISH in steps:
                started += self._submit(self._finishers, (name, "finish"), self._run_steps, name, [Step.FINISH],
                                        honor_backoff)
            others = sorted(steps - {Step.FINISH}, key=list(Step).index)
            if others and not self._in_flight((name, "finish")):  # its decided commits first
                started += self._submit(self._workers, (name, "steps"), self._run_steps, name, others, honor_backoff)
        started += self._sweeps(honor_backoff)
        if wait:
            for future in started:
                for part in future.result():
                    _merge(report.sinks.setdefault(part.name, SinkReport(part.name)), part)
        for future in self._observe_lag(in_flight):  # after the steps when waiting: a test's queued failure is theirs
            if wait:
                future.result()
        if self.history_retention is not None:
            report.pruned = self._prune()
        return report

    def _due(self) -> tuple[recovery_rules.DueWork, dict[int, str], set[str]]:
        c = self.coordinator

        def read(conn: Connection) -> tuple[recovery_rules.DueWork, dict[int, str], set[str]]:
            decided = batches.decided_checkpoints(conn)
            unresolved = leases.unresolved(conn)
            involved = {x.sink_id for x in unresolved} | {x.sink_id for x in decided}
            live = {s.id: s for s in sinks.by_ids(conn, involved) if s.retired_at is None}
            times = {s.id: SinkTimes(s.commit_margin_ms, s.transaction_timeout_ms) for s in live.values()}
            due = recovery_rules.due_work([x for x in decided if x.sink_id in live],
                                          [x for x in unresolved if x.sink_id in live], times,
                                          c.clock.now_in(conn), self.finish_grace_ms)
            in_flight = {live[x.sink_id].name for x in unresolved if x.sink_id in live and x.state in MAY_HOLD_TRANSACTION}
            return due, {s.id: s.name for s in live.values()}, in_flight

        return c.ctx.read(read)

    def _submit(self, pool: Any, key: tuple[str, str], fn: Callable[..., list[SinkReport]],
                *args: Any) -> list[Future[list[SinkReport]]]:
        """fn(*args) on a worker, unless the same work of the previous pass is still running (the
        next pass looks again)."""
        with self._lock:
            if key in self._running:
                return []
            future = pool.submit(fn, *args)
            self._running[key] = future
        future.add_done_callback(lambda _: self._done(key))
        return [future]

    def _in_flight(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._running

    def _done(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._running.pop(key, None)

    def _run_steps(self, name: str, steps: list[Step], honor_backoff: bool) -> list[SinkReport]:
        r = SinkReport(name)
        c = self.coordinator
        for step in steps:
            if honor_backoff and self._backing_off(name, step.value):
                r.skipped.append(step.value)
                continue
            try:
                if step is Step.FINISH:
                    out = c.finish_decided_commits(name, self.finish_grace_ms)
                    r.committed, r.lost, r.commit_pending = out.committed, out.lost, out.failed
                    if out.failed:
                        raise RuntimeError(f"decided commits still pending: {out.failed}")
                elif step is Step.ABORTS:
                    aborted = c.run_pending_aborts(name)
                    r.aborted += aborted.aborted
                    r.abort_pending += aborted.pending
                elif step is Step.EXPIRED:
                    expired, aborted = c.abort_expired_leases(name)
                    r.expired = [x.transactional_id for x in expired]
                    r.aborted += aborted.aborted
                    r.abort_pending += aborted.pending
                elif step is Step.NEAR_TIMEOUT:
                    near, new = c.warn_near_timeout(name)
                    r.near_timeout = [x.transactional_id for x in near]
                    r.warned = [x.transactional_id for x in new]
            except Exception as exc:  # noqa: BLE001 - one failing step must not stop the others
                r.errors[step.value] = f"{type(exc).__name__}: {exc}"
                self._failed(name, step.value, exc)
            else:
                self._succeeded(name, step.value)
        if r.lost:
            log.error("recovery loop: sink %s lost data in batches %s; it is halted until acknowledged", name, r.lost)
        return [r]

    def _observe_lag(self, names: set[str]) -> list[Future[list[SinkReport]]]:
        """The partitions' lag gauges of the sinks with a transaction in flight, and once more of
        those whose transactions ended since the last pass (the gauge follows the broker back)."""
        if self.coordinator.control_plane is None:
            return []
        observed, self._transacting = self._transacting | names, names
        started = []
        for name in sorted(observed):
            started += self._submit(self._workers, (name, "lag"), self._lag, name)
        return started

    def _lag(self, name: str) -> list[SinkReport]:
        record_lso_lag(self.coordinator, name)  # never raises
        return []

    # --- the sweep, per cluster -------------------------------------------------------------------

    def _sweeps(self, honor_backoff: bool) -> list[Future[list[SinkReport]]]:
        """Every sweep interval, one sweep per Kafka cluster of the live sinks."""
        c = self.coordinator
        now = self._monotonic()
        if c.control_plane is None or self.sweep_interval_ms is None or now < self._next_sweep:
            return []
        self._next_sweep = now + self.sweep_interval_ms / 1000
        by_cluster: dict[str, list[Sink]] = {}
        for sink in c.list_sinks():
            by_cluster.setdefault(_cluster_key(sink.bootstrap_servers), []).append(sink)
        started = []
        for cluster, members in sorted(by_cluster.items()):
            if honor_backoff and self._backing_off(cluster, SWEEP):
                continue
            started += self._submit(self._workers, (cluster, SWEEP), self._sweep_cluster, cluster, members)
        return started

    def _sweep_cluster(self, cluster: str, members: list[Sink]) -> list[SinkReport]:
        """One ListTransactions for every sink on the cluster, matched to each by its prefix."""
        c = self.coordinator
        reports = {s.name: SinkReport(s.name) for s in members}
        try:
            first = members[0]
            listed = c.ctx.plane().list_open_transactions(
                KafkaTarget(first.name, first.bootstrap_servers, first.transaction_timeout_ms), "")
            failed = {}
            for sink in members:
                stem = transactional_id_stem(sink.transactional_id_prefix)
                out = c.sweep_open_transactions(sink, [t for t in listed if t.transactional_id.startswith(stem)])
                reports[sink.name].lingering_found = [t.transactional_id for t in out.found]
                reports[sink.name].lingering_aborted = out.aborted
                failed.update(out.failed)
            if failed:
                raise RuntimeError(f"lingering transactions not aborted: {failed}")
        except Exception as exc:  # noqa: BLE001
            for r in reports.values():
                r.errors[SWEEP] = f"{type(exc).__name__}: {exc}"
            self._failed(cluster, SWEEP, exc, _cluster_label(cluster, members))
        else:
            self._succeeded(cluster, SWEEP, _cluster_label(cluster, members))
        return list(reports.values())

    # --- backoff --------------------------------------------------------------------------------

    def _backing_off(self, name: str, step: str) -> bool:
        b = self._backoff.get((name, step))
        return b is not None and self._monotonic() < b.until

    def _failed(self, name: str, step: str, exc: Exception, label: str | None = None) -> None:
        """Back the step off (exponential, capped); say so once per change of failure."""
        error = f"{type(exc).__name__}: {exc}"
        metrics.RECOVERY_ERRORS.labels(step).inc()
        b = self._backoff.setdefault((name, step), _Backoff())
        b.failures += 1
        delay_ms = min(self.interval_ms * 2 ** b.failures, self.max_backoff_ms)
        b.until = self._monotonic() + delay_ms * random.uniform(0.8, 1.0) / 1000
        # once per change of state, not per try: a broker that stays down is said once
        changed = _without_figures(error) != _without_figures(b.error)
        b.error = error
        log.log(logging.WARNING if changed else logging.DEBUG,
                "recovery loop: step %s of %s failed (%d in a row; next try in %.1f s): %s",
                step, label or f"sink {name}", b.failures, delay_ms / 1000, error)

    def _succeeded(self, name: str, step: str, label: str | None = None) -> None:
        failed = self._backoff.pop((name, step), None)
        if failed is not None:
            log.info("recovery loop: step %s of %s succeeds again after %d failure(s)", step, label or f"sink {name}",
                     failed.failures)

    # --- leadership, pruning, the thread -----------------------------------------------------------

    def _acquire(self) -> int | None:
        token = self.lease.acquire()
        if token != self._token:
            if token is None:
                log.warning("recovery loop: %s no longer leads (token %s)", self.holder, self._token)
            else:
                log.info("recovery loop: %s leads with fencing token %s", self.holder, token)
        self._token = token
        metrics.RECOVERY_LEADER.set(1 if token is not None else 0)
        return token

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

    def start(self) -> RecoveryLoop:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._run, name="recovery-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0, *, release: bool = True) -> None:
        """Stop the thread (running steps end their current call) and give the leadership up."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._finishers.shutdown(wait=False, cancel_futures=True)
        self._workers.shutdown(wait=False, cancel_futures=True)
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
                self.run_once(honor_backoff=True, wait=False)
                failures = 0
                delay_ms = self.interval_ms
            except Exception:  # the database is unreachable, or a bug: back off, never die
                failures += 1
                metrics.RECOVERY_ERRORS.labels("iteration").inc()
                delay_ms = min(self.interval_ms * 2 ** failures, self.max_backoff_ms)
                log.exception("recovery loop iteration failed (%d in a row; next try in %.1f s)",
                              failures, delay_ms / 1000)
            self._stop.wait(delay_ms * random.uniform(0.9, 1.0) / 1000)


def _cluster_key(bootstrap_servers: str) -> str:
    return ",".join(sorted(s.strip() for s in bootstrap_servers.split(",") if s.strip()))


def _cluster_label(cluster: str, members: list[Sink]) -> str:
    names = ", ".join(s.name for s in members[:5]) + (f" and {len(members) - 5} more" if len(members) > 5 else "")
    return f"cluster {cluster} (sink{'s' if len(members) > 1 else ''} {names})"


def _without_figures(error: str) -> str:
    """An error's text without its numbers (durations, try counts): the same failure again."""
    return re.sub(r"\d+(\.\d+)?", "#", error)


def _merge(into: SinkReport, part: SinkReport) -> None:
    for name, value in part.__dict__.items():
        if name == "name":
            continue
        target = getattr(into, name)
        if isinstance(value, dict):
            target.update(value)
        else:
            target.extend(value)
