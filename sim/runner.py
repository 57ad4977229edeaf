"""One seeded schedule: a fresh sink, simulated Spark writing N batches through the real
coordinator (real Postgres) into the Kafka model, faults injected at every step; then quiescence
and the checker (I1-I7, F1, F2, L1, R1).

Everything runs on one thread and draws from one random.Random(seed): the same seed gives the
same faults at the same steps and the same trace (the begin races of races.py run a second thread
whose order the database's locks decide). Nothing sleeps; time is a ManualClock shared by the
coordinator and the model (the model aborts transactions past their timeout as it moves); the
recovery loop's workers run in simulated time (virtual_time.py).

The parts: the deployment (replicas.py), simulated Spark (spark.py, which sees the Sim only
through its `SimWorld` protocol), the fault dice and injector (faults.py), the Kafka model
(kafka_model.py), the fault kinds that need more than a roll (races.py, faults_of_time.py), the
checks (checks.py), and deliberately broken variants of the system under test (broken.py).
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete, event, text

from coordinator.protocol import errors as e
from coordinator.protocol import recovery_rules
from coordinator.protocol.configuration import CommitReach
from coordinator.protocol.invariants import Snapshot, check_unchanged
from coordinator.protocol.states import CheckpointState
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.service.clock import Clock, ManualClock
from coordinator.store import tables

from . import races
from .checks import ScheduleChecks
from .faults import ClientGaveUp, CoordinatorCrash, DriverCrash, FaultConfig, Faults, InjectedDbFailure, Injector
from .faults_of_time import TimeFaults
from .races import RaceFaults
from .kafka_model import KafkaModel
from .replicas import Client, Replica, SkewedClock
from .spark import CheckpointLocation, Driver, JobFailed, ZombieState, batch_input, zombie_call

TIMEOUT_MS = 10_000
MARGIN_MS = 2_000
# The deployment's commit reach, small enough for the margin: the recovery loop leaves a decision
# younger than its grace (retry budget + request timeout) to the call that made it.
REACH = CommitReach(request_timeout_ms=200, retry_budget_ms=300, leader_ttl_ms=600, recovery_interval_ms=200)
MAX_DRIVER_RUNS = 8
RUN_NONCE = uuid.uuid4().hex[:6]  # sink names differ between processes sharing a database

# What a recovery step may fail with in a schedule: the faults it injects (the broker, the database)
# and the loop's own "still pending" reports. Anything else is a coordinator bug the invariants may
# not show.
EXPECTED_STEP_ERRORS = (
    "ControlPlaneError: ",
    "RuntimeError: decided commits still pending: ",
    "RuntimeError: lingering transactions not aborted: ",
)


@dataclass
class ScheduleResult:
    seed: int
    violations: list[str]
    faults: Any
    fault_list: list[str]
    trace: list[str]
    batches: int
    committed: int

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self, trace_lines: int = 60) -> str:
        lines = [f"seed {self.seed}: {len(self.violations)} violation(s)"]
        lines += [f"  VIOLATION {v}" for v in self.violations]
        lines.append(f"  faults: {', '.join(self.fault_list) or 'none'}")
        lines.append(f"  trace (last {trace_lines} of {len(self.trace)} lines):")
        lines += [f"    {t}" for t in self.trace[-trace_lines:]]
        lines.append(f"  replay: python -m sim replay {self.seed}")
        return "\n".join(lines)


class Sim(TimeFaults, RaceFaults, ScheduleChecks):
    def __init__(self, seed: int, engine: Engine, config: FaultConfig | None = None, *, n_batches: int | None = None,
                 one_clock: bool = True, recovery_grace_ms: int | None = None, serial_recovery: bool = False,
                 guessed_first_tries: bool = False) -> None:
        self.seed = seed
        self.one_clock = one_clock  # False: the broken variant whose protocol reads each replica's own clock
        self.reach = REACH
        self.recovery_grace_ms = REACH.recovery_grace_ms if recovery_grace_ms is None else recovery_grace_ms
        self.serial_recovery = serial_recovery  # the broken variant whose loop serves every sink on one worker
        self.guessed_first_tries = guessed_first_tries  # the broken variant of the client (broken.py)
        self.engine = engine
        self.rng = random.Random(seed)
        self.faults = Faults(self.rng, config or FaultConfig())
        self.clock = ManualClock()
        self.model = KafkaModel(self.clock)
        self.injector = Injector(self)
        self.lines: list[str] = []
        self.violations: list[str] = []
        self.op = ""
        self.n_batches = n_batches if n_batches is not None else self.rng.randint(2, 5)
        self.sink = f"sim-{RUN_NONCE}-{seed}"
        self.prefix = f"p{RUN_NONCE}s{seed}x"
        self.topic = "out"
        self.timeout_ms = TIMEOUT_MS
        self.margin_ms = MARGIN_MS
        # small bounds, so that ids freed from tries that did not win leave quarantine within a schedule
        self.limits = Limits(max_partitions=64, kafka_parallelism=1, lease_max_init_age_ms=3_000,
                             producer_init_timeout_ms=3_000, producer_request_timeout_ms=1_000,
                             transactional_id_quarantine_ms=8_000, history_min_retention_ms=0, commit_reach=REACH)
        self.small_delay_ms = MARGIN_MS // 10
        self.ckpt = CheckpointLocation(query_id=f"query-{seed}")
        self.client = Client(self)
        self.unreachable: set[str] = set()  # Kafka clusters that answer nothing (races.unreachable_neighbours)
        self.other_sinks: list[int] = []  # sinks of this schedule besides its own (cleaned up with it)
        self._leases: dict[int, str] = {}
        self.pending_zombies: list[ZombieState] = []
        self.replicas: list[Replica] = []
        self.sink_id: int | None = None
        self.last_snapshot: Snapshot | None = None
        self.clocks: dict[int, SkewedClock] = {}
        TimeFaults.__init__(self)

    # --- small helpers ------------------------------------------------------------------------

    def trace(self, line: str) -> None:
        self.lines.append(line)

    def local(self, key: str) -> str:
        """A transactional id (or prefix) without the run's prefix, for traces that replay the same."""
        return "id" + key[len(self.prefix):] if key.startswith(self.prefix) else key

    def locals(self, keys: list[str]) -> list[str]:
        return [self.local(k) for k in keys]

    def local_lease(self, lease_id: int | None) -> str | None:
        if lease_id is None:
            return None
        return self._leases.setdefault(lease_id, f"L{len(self._leases) + 1}")

    def replica_clock(self, index: int) -> Clock:
        return self.clocks.setdefault(index, SkewedClock(self.clock, one_clock=self.one_clock))

    def timeline(self, replica: Replica) -> Any:
        """What a replica's recovery workers need of simulated time (virtual_time.Timeline)."""
        sim = self

        class _Timeline:
            def now(self) -> datetime:
                return sim.clock.now()

            def advance(self, ms: int) -> None:
                sim.advance(ms)

            def busy_ms(self) -> int:
                return replica.plane.busy_ms

            def reset_busy(self) -> None:
                replica.plane.busy_ms = 0

        return _Timeline()

    def race_begin(self, batch: int, generation: int, partitions: int, digest: str, run_id: str) -> None:
        self.begin_racing_a_new_generation(batch, generation, partitions, digest, run_id)

    def pick_replica(self) -> Replica:
        return self.replicas[self.rng.randrange(len(self.replicas))]

    def restart_replica(self, replica: Replica) -> None:
        self.trace(f"  coordinator replica {replica.index} restarted")
        replica.restart()

    def orphan_call(self, name: str, fn: Callable[[Coordinator], Any]) -> None:
        """A call whose client is gone (the driver died with it in flight), and the replica serving
        it dies at its first or second Kafka call: nobody retries it, so what it decided is left to
        the next driver's begin or to the recovery loop."""
        self.faults.fired("orphaned_commit", name)
        self.trace(f"  !! the driver dies with its {name} in flight; the replica serving it dies too")
        replica = self.pick_replica()
        with self.operation(f"{name} (orphaned)", inject=False):
            self.injector.arm("crash_kafka", self.rng.randint(1, 2), self.rng.choice(["before", "after"]))
            try:
                fn(replica.coordinator)
            except (CoordinatorCrash, Exception):  # noqa: BLE001 - the crash or the call's own refusal: no one hears it
                pass
            died = self.injector.dead
        if died:
            self.restart_replica(replica)

    @contextmanager
    def operation(self, name: str, *, inject: bool) -> Iterator[None]:
        """One coordinator operation: maybe arm a crash / connection failure at a step inside it."""
        self.op = name
        inj = self.injector
        if inject:
            f = self.faults
            if f.roll("coordinator_crash"):
                where = self.rng.choice(["crash_db", "crash_db", "crash_kafka"])
                inj.arm(where, self.rng.randint(1, 12), self.rng.choice(["before", "after"]))
            elif f.roll("db_failure"):
                inj.arm("db_failure", self.rng.randint(1, 12))
            inj.kafka_faults = f.enabled
        try:
            yield
        finally:
            inj.disarm()
            self.op = ""

    # --- recovery -------------------------------------------------------------------------------

    def recovery_tick(self, why: str, *, inject: bool = True, replica: Replica | None = None) -> None:
        """One iteration of a replica's recovery loop (a random one's unless named)."""
        if replica is None:
            replica = self.pick_replica()
        if inject:
            self.maybe_step_clock_back()
        if inject and len(self.replicas) > 1 and self.faults.roll("leader_failover"):
            self.faults.fired("leader_failover")
            self.trace("  !! recovery leader steps down")
            self.release_leadership()
        try:
            with self.operation(f"recovery run_once (replica {replica.index})", inject=inject):
                try:
                    report = replica.loop.run_once()
                except Exception as exc:
                    if self.injector.dead:
                        raise CoordinatorCrash("recovery") from exc
                    raise
                if self.injector.dead:  # the crash was swallowed by a step's error handler
                    raise CoordinatorCrash("recovery")
        except CoordinatorCrash:
            self.restart_replica(replica)
            return
        except InjectedDbFailure:
            return
        self.maybe_prune_history(replica, inject=inject)
        mine = report.sinks.get(self.sink)
        for step, error in (mine.errors if mine is not None else {}).items():
            if not error.startswith(EXPECTED_STEP_ERRORS) and "InjectedDbFailure" not in error:
                self.violations.append(f"RECOVERY: step {step} failed with what no fault explains: {error[:300]}")
        if mine is not None:
            done = [f"{k}={v}" for k, v in (("committed", mine.committed), ("lost", mine.lost),
                                             ("expired", self.locals(mine.expired)), ("aborted", self.locals(mine.aborted)),
                                             ("lingering", self.locals(mine.lingering_aborted))) if v]
            if done or mine.errors:
                self.trace(f"  recovery (replica {replica.index}, {why}): {' '.join(done)} {mine.errors or ''}")

    def maybe_prune_history(self, replica: Replica, *, inject: bool) -> None:
        """An operator prunes the history of every committed batch but each query's newest, a few
        batches at a time (faults may fire inside it, as in any operation)."""
        if not self.faults.config.history_prune or not self.faults.roll("history_prune"):
            return
        limit = self.rng.randint(1, 4)
        try:
            with self.operation("prune_history", inject=inject):
                try:
                    outcome = replica.coordinator.prune_history(timedelta(0), "sim", sink=self.sink, limit=limit)
                except Exception as exc:
                    if self.injector.dead:
                        raise CoordinatorCrash("prune_history") from exc
                    raise
        except CoordinatorCrash:
            self.restart_replica(replica)
            return
        except InjectedDbFailure:
            return
        if outcome.pruned:
            self.faults.fired("history_prune", str(outcome.pruned))
            self.trace(f"  operator: pruned the history of {outcome.pruned} committed batch(es)")

    def release_leadership(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("UPDATE recovery_leader SET expires_at = now() - interval '1 millisecond'"))

    def unfinished_decisions(self) -> list[datetime]:
        """When each decided commit of the sink still to finish was decided: COMMITTING checkpoints,
        and LOST ones with winners still to commit (a refused winner does not stop the others)."""
        snap = self.sink_snapshot()
        return [c.decided_at or self.clock.now() for c in snap.checkpoints
                if c.id in recovery_rules.checkpoints_to_finish(snap.checkpoints, snap.leases)]

    def finish_decided_commits(self, why: str, iterations: int) -> int:
        """Recovery iterations until no decided commit is left unfinished; the ms waited. The loop
        leaves a decision younger than its grace to the call that made it, so time first moves on
        to when the youngest is due, as the loop's next iteration in a deployment would find it.
        Every replica's loop runs (only the leader's acts), as in a deployment."""
        waited = 0
        for _ in range(iterations):
            decided = self.unfinished_decisions()
            if not decided:
                break
            due_in = math.ceil((max(decided) - self.clock.now()) / timedelta(milliseconds=1)) + self.recovery_grace_ms
            if due_in > 0:
                self.advance(due_in)
                waited += due_in
            self.every_recovery_loop(why)
        return waited

    def every_recovery_loop(self, why: str) -> None:
        for replica in self.replicas:
            self.recovery_tick(why, inject=False, replica=replica)

    # --- zombies (I5) -------------------------------------------------------------------------

    def on_generation_started(self, driver: Driver) -> None:
        for z in self.pending_zombies:
            if z.generation < 0 or z.generation >= (driver.generation or 0):
                continue
            what, thunk = zombie_call(self, z)
            self.check_stale_call(f"zombie generation {z.generation} {what}", thunk)
        self.pending_zombies.clear()

    def check_stale_call(self, what: str, thunk: Callable[[Coordinator], Any]) -> None:
        before = self.sink_snapshot()
        outcome = "accepted"
        with self.operation(what, inject=False):
            try:
                thunk(self.replicas[0].coordinator)
            except e.Conflict as exc:
                outcome = f"409 {exc.reason}"
            except e.ProtocolError as exc:
                outcome = f"{exc.status} {exc.reason}"
        after = self.sink_snapshot()
        self.trace(f"  {what}: {outcome}")
        if not outcome.startswith("409"):
            self.violations.append(f"I5: stale call {what} was not refused with a 409 ({outcome})")
        self.violations += [f"{v} ({what})" for v in map(str, check_unchanged(before, after))]

    def cleanup(self) -> None:
        ids = [x for x in (self.sink_id, *self.other_sinks) if x is not None]
        if not ids:
            return
        t = tables
        with self.engine.begin() as conn:
            for table in (t.events, t.leases, t.attempts, t.checkpoints, t.generations, t.quarantined_ids, t.id_pools):
                conn.execute(delete(table).where(table.c.sink_id.in_(ids)))
            conn.execute(delete(t.sinks).where(t.sinks.c.id.in_(ids)))

    # --- the schedule -------------------------------------------------------------------------

    def run(self) -> ScheduleResult:
        self.release_leadership()  # leadership is per database: no schedule inherits another's
        n_replicas = 2 if self.faults.roll("two_replicas") else 1
        if n_replicas == 2:
            self.faults.fired("two_replicas")
        self.replicas = [Replica(self, i) for i in range(n_replicas)]
        self.maybe_skew_clocks()
        try:
            self._run()
        finally:
            for r in self.replicas:
                r.coordinator.close()
                r.loop.stop(release=False)
        return ScheduleResult(self.seed, self.violations, self.faults.counts, self.faults.fired_list, self.lines,
                              self.n_batches, len(self.ckpt.commits))

    def _run(self) -> None:
        spec = SinkSpec(self.sink, self.prefix, "model:9092", [self.topic], transaction_timeout_ms=self.timeout_ms,
                        commit_margin_ms=self.margin_ms)
        sink, _ = self.client.call("register_sink", lambda c: c.register_sink(spec, "sim"))
        self.sink_id = sink.id
        self.trace(f"schedule seed {self.seed}: {self.n_batches} batches, {len(self.replicas)} replica(s), "
                   f"inputs {[len(batch_input(self.seed, b)) for b in range(self.n_batches)]}")
        self.unreachable_neighbours()
        runs = 0
        while len(self.ckpt.commits) < self.n_batches and runs < MAX_DRIVER_RUNS + 2:
            runs += 1
            if runs > MAX_DRIVER_RUNS:  # the operator's last restart: faults off
                self.faults.enabled = False
            if runs > 1 and self.faults.enabled:
                self.maybe_restore_checkpoint()
            driver = Driver(self, runs)
            try:
                driver.run()
            except DriverCrash:
                if self.faults.roll("zombie_driver"):
                    self.faults.fired("zombie_driver")
                    self.pending_zombies.append(driver.zombie)
            except (e.ProtocolError, ClientGaveUp, JobFailed) as exc:
                # (database ids differ between runs: a protocol error is traced by its reason only)
                why = exc.reason if isinstance(exc, e.ProtocolError) else f"{type(exc).__name__}: {exc}"
                self.trace(f"driver {driver.run_id}: query failed ({why})")
                if isinstance(exc, e.Conflict) and "offset" in exc.reason:
                    self.operator_restores_newest_checkpoint(exc.reason)
            if self.faults.roll("driver_down_long"):
                self.driver_stays_down()
            else:
                self.advance(self.rng.randint(0, self.small_delay_ms))  # the restart takes a moment
            self.check_db(settled=False, when=f"after driver run {runs}")
        self.faults.enabled = False
        self.quiesce()
        self.retire_while_a_begin_runs()
        self.check_end()

    def quiesce(self) -> None:
        """Recovery until nothing is left to finish; I6 while transactions can still be open; then
        past every timeout, and recovery again."""
        self.fire_all_executor_zombies()
        self.release_leadership()
        self.every_recovery_loop("quiesce")
        self.finish_decided_commits("quiesce", 5)
        self.check_unexplained_open()
        self.trace("quiesce: clock moves past every transaction timeout")
        self.advance(self.timeout_ms + self.margin_ms)
        for _ in range(3):
            self.recovery_tick("quiesce", inject=False)


_hooked: set[int] = set()
_current: dict[str, Sim | None] = {"sim": None}


def prepare_engine(engine: Engine) -> None:
    """Install the statement hook through which faults fire inside the coordinator's operations."""
    if id(engine) in _hooked:
        return
    _hooked.add(id(engine))

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        sim = _current.get("sim")
        if sim is not None and races.is_main_thread():
            sim.injector.on_statement()

    event.listen(engine, "before_cursor_execute", before)


def run_schedules(engine: Engine, seeds: range | list[int], config: FaultConfig | None = None,
                  progress: Callable[[int, ScheduleResult], None] | None = None, **kw: Any) -> list[ScheduleResult]:
    prepare_engine(engine)
    out = []
    for i, seed in enumerate(seeds):
        out.append(run_one(engine, seed, config, **kw))
        if progress is not None:
            progress(i, out[-1])
    return out


def run_one(engine: Engine, seed: int, config: FaultConfig | None = None, **kw: Any) -> ScheduleResult:
    """Run one schedule (keep_on_failure=False deletes its rows even when it failed)."""
    return run_and_keep(engine, seed, config, **kw)[0]


def run_and_keep(engine: Engine, seed: int, config: FaultConfig | None = None, **kw: Any) -> tuple[ScheduleResult, Sim]:
    """`run_one`, also returning the finished Sim: its Kafka model (the output topic) and Spark's
    checkpoint location (which batches committed), for checks of the output from outside."""
    prepare_engine(engine)
    # a failing schedule's rows are deleted too (unless asked to keep them for inspection): a later
    # schedule's recovery loop would otherwise work on its sink, and no seed would replay alone
    keep = kw.pop("keep_on_failure", False)
    sim = Sim(seed, engine, config, **kw)
    _current["sim"] = sim
    races.on_the_schedules_thread()
    try:
        result = sim.run()
    except Exception as exc:  # noqa: BLE001 - a crash of the simulation itself is a finding
        import traceback

        sim.violations.append(f"SIM: {type(exc).__name__}: {exc}")
        sim.trace(traceback.format_exc()[-3000:])
        result = ScheduleResult(seed, sim.violations, sim.faults.counts, sim.faults.fired_list, sim.lines,
                                sim.n_batches, len(sim.ckpt.commits))
    finally:
        _current["sim"] = None
    if result.ok or not keep:
        sim.cleanup()
    return result, sim
