"""One seeded schedule: a fresh sink, simulated Spark writing N batches through the real
coordinator (real Postgres) into the Kafka model, faults injected at every step; then quiescence
and the checker (I1-I7).

Everything runs on one thread and draws from one random.Random(seed): the same seed gives the
same faults at the same steps and the same trace. Nothing sleeps; time is a ManualClock shared by
the coordinator and the model (the model aborts transactions past their timeout as it moves).

Long because `Sim` is one schedule's world (its replicas, client, clocks, zombies, quiescence and
check), read top to bottom in the order a schedule runs; the parts that stand alone are apart:
the fault dice (faults.py), the Kafka model (kafka_model.py), simulated Spark (spark.py, which
sees the Sim only through its `SimWorld` protocol).
"""

from __future__ import annotations

import math
import random
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Engine, delete, event, select, text

from coordinator.protocol import errors as e
from coordinator.protocol import recovery_rules
from coordinator.protocol.invariants import (
    Snapshot,
    Violation,
    check_committed_unchanged,
    check_invariants,
    check_no_quick_reuse,
    check_unchanged,
)
from coordinator.protocol.model import Alert
from coordinator.protocol.states import CheckpointState
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.service.clock import Clock, ManualClock
from coordinator.service.recovery import RecoveryLoop
from coordinator.store import repo
from coordinator.store.tables import (
    attempts,
    checkpoints,
    events,
    generations,
    lease_rows,
    leases,
    sinks,
    transactional_ids,
)

from .faults import (
    ClientGaveUp,
    CoordinatorCrash,
    DriverCrash,
    FaultConfig,
    Faults,
    InjectedDbFailure,
    Injector,
)
from .kafka_model import KafkaError, KafkaModel, ModelControlPlane
from .spark import (
    CheckpointLocation,
    Driver,
    JobFailed,
    ZombieState,
    batch_input,
    kafka_partition,
    zombie_call,
)

T = TypeVar("T")

TIMEOUT_MS = 10_000
MARGIN_MS = 2_000
# The recovery loop leaves a decision this young to the call that made it (the service's
# CommitReach.recovery_grace_ms, its commit retry budget): well inside the margin, as the service's
# settings check requires of a deployment.
RECOVERY_GRACE_MS = MARGIN_MS // 4
MAX_DRIVER_RUNS = 8
# How late a stalled executor try's InitProducerId may still reach the broker after its lease was
# granted (the executor refuses to start init_transactions on an older lease, and the request then
# blocks at most this long). Ids freed from undecided tries must be quarantined longer than this.
EXECUTOR_INIT_REACH_MS = TIMEOUT_MS
RUN_NONCE = uuid.uuid4().hex[:6]  # sink names differ between processes sharing a database
RETRIABLE_UNAVAILABLE = {"kafka_commit_failed", e.POOL_EXHAUSTED}


# What a recovery step may fail with in a schedule: the faults it injects (the broker, the database)
# and the loop's own "still pending" reports. Anything else is a coordinator bug the invariants
# may not show (the near-timeout step failed on every pass after a first try's warning: a lease id
# read as a 32-bit integer).
EXPECTED_STEP_ERRORS = (  # and any error an injected database failure caused
    "ControlPlaneError: ",
    "RuntimeError: decided commits still pending: ",
    "RuntimeError: lingering transactions not aborted: ",
)

class _SyncPool:
    """Stands in for the coordinator's Kafka thread pool: the simulation is single-threaded, so
    the order of Kafka calls (and of the faults drawn for them) is the seed's."""

    def map(self, fn: Callable[[Any], T], items: Any) -> Iterator[T]:
        return map(fn, items)

    def shutdown(self, wait: bool = True) -> None:
        pass


@dataclass
class ScheduleResult:
    seed: int
    violations: list[str]
    faults: Counter[str]
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


class SkewedClock:
    """A replica's own clock: the true (broker's) time plus an offset that can change (a step).
    `now_in(conn)` is the protocol's clock where the coordinator reads one (the database's, the
    same for every replica: the sim's ManualClock); `one_clock=False` is the broken variant in
    which the protocol reads the replica's own clock."""

    def __init__(self, base: ManualClock, offset_ms: int = 0, *, one_clock: bool = True) -> None:
        self.base = base
        self.offset_ms = offset_ms
        self.one_clock = one_clock

    def now(self) -> datetime:
        return self.base.now() + timedelta(milliseconds=self.offset_ms)

    def now_in(self, conn: Any) -> datetime:
        return self.base.now() if self.one_clock else self.now()


@dataclass
class ExecutorZombie:
    """A stalled executor try whose InitProducerId reaches the broker at `fire_at` (true time)."""

    fire_at: datetime
    transactional_id: str
    rows: list[str] = field(default_factory=list)


class Replica:
    """One coordinator process (and its recovery loop) of the deployment."""

    def __init__(self, sim: Sim, index: int) -> None:
        self.sim = sim
        self.index = index
        self.restarts = 0
        self.coordinator: Coordinator
        self.loop: RecoveryLoop
        self.start()

    def start(self) -> None:
        sim = self.sim
        plane = ModelControlPlane(sim.model, hook=sim.injector.kafka_hook)
        c = Coordinator(sim.engine, plane, clock=sim.replica_clock(self.index), limits=sim.limits)
        c._kafka_pool.shutdown(wait=False)
        c._kafka_pool = _SyncPool()  # type: ignore[assignment]
        self.coordinator = c
        self.loop = RecoveryLoop(c, interval_ms=5_000, leader_ttl_ms=600_000, holder=f"sim-replica-{self.index}",
                                 finish_grace_ms=sim.recovery_grace_ms)

    def restart(self) -> None:
        self.restarts += 1
        self.start()  # the dead object is dropped; its leadership row stays until it expires or is taken


class Client:
    """The coordinator client of the driver and the executors: retries the same request after a
    failure, a lost response or a 503, on whichever replica the load balancer picks."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def call(self, name: str, fn: Callable[[Coordinator], T], *, retries: int = 12) -> T:
        sim = self.sim
        f = sim.faults
        for attempt in range(retries):
            replica = sim.pick_replica()
            if f.roll("request_fail"):
                f.fired("request_fail", name)
                sim.trace(f"  !! {name}: request failed")
                continue
            try:
                with sim.operation(name, inject=True):
                    try:
                        result = fn(replica.coordinator)
                    except Exception as exc:
                        if sim.injector.dead:  # whatever surfaced, the process had died
                            raise CoordinatorCrash(name) from exc
                        raise
            except CoordinatorCrash:
                sim.restart_replica(replica)
                continue
            except InjectedDbFailure:
                continue
            except e.Unavailable as exc:
                if exc.reason not in RETRIABLE_UNAVAILABLE:
                    raise
                sim.trace(f"  {name}: 503 {exc.reason}, retrying")
                if attempt % 3 == 2:  # the client backs off; the recovery loop runs meanwhile, as it does every interval
                    sim.recovery_tick(f"while {name} backs off", inject=False)
                continue
            if f.roll("lost_response"):
                f.fired("lost_response", name)
                sim.trace(f"  !! {name}: response lost")
                continue
            if f.roll("duplicate_request"):
                f.fired("duplicate_request", name)
                sim.trace(f"  !! {name}: delivered twice")
                other = sim.pick_replica()
                with sim.operation(name + " (duplicate)", inject=False):
                    result = fn(other.coordinator)
            return result
        raise ClientGaveUp(f"{name}: gave up after {retries} tries")


class Sim:
    def __init__(self, seed: int, engine: Engine, config: FaultConfig | None = None, *, n_batches: int | None = None,
                 one_clock: bool = True, recovery_grace_ms: int = RECOVERY_GRACE_MS) -> None:
        self.seed = seed
        self.one_clock = one_clock  # False: the broken variant whose protocol reads each replica's own clock
        self.recovery_grace_ms = recovery_grace_ms
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
        # small bounds, so that ids freed from undecided tries leave quarantine within a schedule
        self.limits = Limits(max_partitions=64, kafka_parallelism=1, lease_max_init_age_ms=3_000,
                             producer_init_timeout_ms=3_000, producer_request_timeout_ms=1_000,
                             transactional_id_quarantine_ms=8_000, history_min_retention_ms=0)
        self.small_delay_ms = MARGIN_MS // 10
        self.ckpt = CheckpointLocation(query_id=f"query-{seed}")
        self.client = Client(self)
        self._leases: dict[int, str] = {}
        self._tids: dict[str, str] = {}
        self.pending_zombies: list[ZombieState] = []
        self.replicas: list[Replica] = []
        self.sink_id: int | None = None
        self._last_snapshot: Snapshot | None = None
        self.clocks: dict[int, SkewedClock] = {}
        self.executor_zombies: list[ExecutorZombie] = []
        self.restores = 0  # checkpoint restores from an older backup so far
        self.replanned: set[int] = set()  # batches whose committed plan the restore dropped
        self.newest_checkpoint: CheckpointLocation | None = None  # what the operator can put back

    # --- small helpers ------------------------------------------------------------------------

    def trace(self, line: str) -> None:
        self.lines.append(line)

    def local(self, key: str) -> str:
        """A transactional id (or prefix) without the run's prefix, for traces that replay the same."""
        if key.startswith(self.prefix):
            return "id" + key[len(self.prefix):]
        return key

    def locals(self, keys: list[str]) -> list[str]:
        return [self.local(k) for k in keys]

    def local_lease(self, lease_id: int | None) -> str | None:
        if lease_id is None:
            return None
        return self._leases.setdefault(lease_id, f"L{len(self._leases) + 1}")

    def advance(self, ms: int) -> None:
        """Move true time on; stalled executors' InitProducerIds land at their moment on the way."""
        target = self.clock.now() + timedelta(milliseconds=ms)
        while True:
            due = [z for z in self.executor_zombies if z.fire_at <= target]
            if not due:
                break
            z = min(due, key=lambda x: x.fire_at)
            self.executor_zombies.remove(z)
            self._move_clock(max(0, int((z.fire_at - self.clock.now()) / timedelta(milliseconds=1))))
            self._fire_executor_zombie(z)
        self._move_clock(max(0, int((target - self.clock.now()) / timedelta(milliseconds=1))))

    def _move_clock(self, ms: int) -> None:
        if ms:
            self.clock.advance(ms=ms)
            for tid in self.model.expire():
                self.trace(f"  broker aborted {self.local(tid)} at its timeout")

    def replica_clock(self, index: int) -> Clock:
        return self.clocks.setdefault(index, SkewedClock(self.clock, one_clock=self.one_clock))

    def executor_init_reach_ms(self, limits: Any) -> int:
        """How late a stalled try's InitProducerId may land after its lease: the protocol's bound
        (lease age at init + init timeout + request timeout) where the coordinator has one, else
        EXECUTOR_INIT_REACH_MS."""
        parts = [getattr(limits, n, None) for n in
                 ("lease_max_init_age_ms", "producer_init_timeout_ms", "producer_request_timeout_ms")]
        return sum(parts) if all(p is not None for p in parts) else EXECUTOR_INIT_REACH_MS  # type: ignore[arg-type]

    # --- issue 15's fault kinds ---------------------------------------------------------------

    def executor_zombie(self, transactional_id: str, rows: list[str]) -> None:
        delay = self.rng.randint(1, self.executor_init_reach_ms(self.replicas[0].coordinator.limits))
        self.faults.fired("zombie_executor", f"{self.local(transactional_id)} +{delay}ms")
        self.trace(f"  !! executor try on {self.local(transactional_id)} stalls before InitProducerId "
                   f"(lands in {delay} ms)")
        self.executor_zombies.append(ExecutorZombie(self.clock.now() + timedelta(milliseconds=delay),
                                                    transactional_id, list(rows)))

    def _fire_executor_zombie(self, z: ExecutorZombie) -> None:
        try:
            pid, epoch = self.model.init_producer_id(z.transactional_id, self.timeout_ms)
            self.trace(f"  !! stalled executor's InitProducerId on {self.local(z.transactional_id)} lands: "
                       f"epoch {epoch}")
            if self.rng.random() < 0.5:  # and it writes its rows before it learns it was given up on
                for row in z.rows:
                    self.model.produce(z.transactional_id, pid, epoch, self.topic, kafka_partition(row), row)
                self.trace(f"  !! the stalled executor produced {len(z.rows)} record(s), never pre-committed")
        except KafkaError as exc:
            self.trace(f"  stalled executor refused by the broker: {exc.code}")

    def fire_all_executor_zombies(self) -> None:
        if self.executor_zombies:
            last = max(z.fire_at for z in self.executor_zombies)
            self.advance(max(0, int((last - self.clock.now()) / timedelta(milliseconds=1))))

    def maybe_skew_clocks(self) -> None:
        """The second replica's clock is off by more than the margin (NTP trouble, a VM pause)."""
        if len(self.replicas) < 2 or not self.faults.roll("clock_skew"):
            return
        skew = self.rng.choice([-1, 1]) * self.rng.randint(self.margin_ms, 5 * self.margin_ms)
        self.clocks[1].offset_ms = skew
        self.faults.fired("clock_skew", f"replica 1 {skew:+d}ms")
        self.trace(f"  !! replica 1's clock is {skew:+d} ms off")

    def maybe_step_clock_back(self) -> None:
        clock = self.clocks.get(1)
        if clock is None or clock.offset_ms == 0 or self.rng.random() >= 0.1:
            return
        step = self.rng.randint(self.margin_ms, 3 * self.margin_ms)
        clock.offset_ms -= step
        self.faults.fired("clock_skew", f"replica 1 steps back {step}ms")
        self.trace(f"  !! replica 1's clock steps back {step} ms")

    def plan_input(self, batch: int) -> list[str]:
        """The records Spark plans for a batch: the deterministic input, and after a checkpoint
        restore the batches it dropped are re-planned from the same start over more records."""
        base = batch_input(self.seed, batch)
        if batch in self.replanned:
            base = base + [f"b{batch}r{len(base) + i}R{self.restores}" for i in range(self.rng.randint(1, 3))]
        return base

    def maybe_restore_checkpoint(self) -> None:
        """Spark's checkpoint directory is restored from an older backup: the same query id, but the
        newest commits (and their offset log entries) are gone, so those batch ids are planned again."""
        if not self.ckpt.commits or not self.faults.roll("checkpoint_restore"):
            return
        k = self.rng.choice(sorted(self.ckpt.commits))
        newest = CheckpointLocation(self.ckpt.query_id, dict(self.ckpt.offsets), set(self.ckpt.commits))
        if self.newest_checkpoint is None:
            self.newest_checkpoint = newest
        dropped = {b for b in self.ckpt.offsets if b >= k}
        self.ckpt.offsets = {b: v for b, v in self.ckpt.offsets.items() if b < k}
        self.ckpt.commits = {b for b in self.ckpt.commits if b < k}
        self.restores += 1
        self.replanned |= dropped
        self.faults.fired("checkpoint_restore", f"back to batch {k}")
        self.trace(f"  !! checkpoint restored from a backup taken before batch {k} (batches {sorted(dropped)} "
                   "will be planned again)")

    def operator_restores_newest_checkpoint(self, why: str) -> bool:
        """The coordinator refused a replay over different offsets: the operator puts back the
        newest checkpoint (the reset path of the refusal). False if there was no restore to undo."""
        if self.newest_checkpoint is None:
            return False
        self.ckpt.offsets, self.ckpt.commits = self.newest_checkpoint.offsets, self.newest_checkpoint.commits
        self.newest_checkpoint = None
        self.replanned.clear()
        self.trace(f"operator: replay refused ({why}); the newest checkpoint is put back")
        return True

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

    # --- recovery, time ---------------------------------------------------------------------------

    def recovery_tick(self, why: str, *, inject: bool = True, replica: Replica | None = None) -> None:
        """One iteration of a replica's recovery loop (a random one's unless named)."""
        if replica is None:
            replica = self.pick_replica()
        if inject:
            self.maybe_step_clock_back()
        if inject and len(self.replicas) > 1 and self.faults.roll("leader_failover"):
            self.faults.fired("leader_failover")
            self.trace("  !! recovery leader steps down")
            self._release_leadership()
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

    def _release_leadership(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("UPDATE recovery_leader SET expires_at = now() - interval '1 millisecond'"))

    def unfinished_decisions(self) -> list[datetime]:
        """When each COMMITTING checkpoint of the sink was decided."""
        assert self.sink_id is not None
        with self.engine.connect() as conn:
            return [at or self.clock.now() for at in conn.execute(select(checkpoints.c.decided_at).where(
                checkpoints.c.sink_id == self.sink_id,
                checkpoints.c.state == CheckpointState.COMMITTING.value)).scalars()]

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

    def maybe_near_timeout(self, where: str, *, task: bool = False) -> None:
        """The clock jumps close to the transaction timeout (a slow task, a long GC, a slow job).
        A correctly configured deployment finishes decided commits well within the margin, so the
        recovery loop finishes a decided commit still unfinished during the pause (its grace is
        part of the pause)."""
        if not self.faults.roll("near_timeout"):
            return
        waited = self.finish_decided_commits("during a long pause", 5)
        jump = max(0, self.timeout_ms - self.margin_ms + self.rng.randint(-self.margin_ms, self.margin_ms) - waited)
        self.faults.fired("near_timeout", f"{jump}ms {where}")
        self.trace(f"  !! clock jumps {jump} ms ({where})")
        self.advance(jump)

    def driver_stays_down(self) -> None:
        """The driver is down past every transaction timeout (a cluster restart, a job resubmitted
        later): no call of its own finishes a commit it decided, only the recovery loop does, and it
        must before the broker aborts the transactions. The loop keeps running after that too."""
        self.faults.fired("driver_down_long")
        self.trace("  !! the driver stays down past the transaction timeout")
        waited = self.finish_decided_commits("while the driver is down", 5)
        self.advance(max(0, self.timeout_ms + self.margin_ms - waited))
        self.every_recovery_loop("while the driver is down")

    # --- zombies (I5) -------------------------------------------------------------------------

    def on_generation_started(self, driver: Driver) -> None:
        for z in self.pending_zombies:
            if z.generation < 0 or z.generation >= (driver.generation or 0):
                continue
            what, thunk = zombie_call(self, z)
            self.check_stale_call(f"zombie generation {z.generation} {what}", thunk)
        self.pending_zombies.clear()

    def check_stale_call(self, what: str, thunk: Callable[[Coordinator], Any]) -> None:
        before = self.snapshot()
        outcome = "accepted"
        with self.operation(what, inject=False):
            try:
                thunk(self.replicas[0].coordinator)
            except e.Conflict as exc:
                outcome = f"409 {exc.reason}"
            except e.ProtocolError as exc:
                outcome = f"{exc.status} {exc.reason}"
        after = self.snapshot()
        self.trace(f"  {what}: {outcome}")
        if not outcome.startswith("409"):
            self.violations.append(f"I5: stale call {what} was not refused with a 409 ({outcome})")
        self.violations += [f"{v} ({what})" for v in map(str, check_unchanged(before, after))]

    # --- database ---------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        sid = self.sink_id
        with self.engine.connect() as conn:
            return Snapshot(
                sinks=[repo._as_sink(r) for r in conn.execute(select(sinks).where(sinks.c.id == sid))],
                checkpoints=[repo.as_checkpoint(r) for r in conn.execute(
                    select(checkpoints).where(checkpoints.c.sink_id == sid).order_by(checkpoints.c.id))],
                attempts=[repo.as_attempt(r) for r in conn.execute(
                    select(attempts).where(attempts.c.sink_id == sid).order_by(attempts.c.id))],
                leases=[repo.as_lease(r) for r in conn.execute(
                    select(leases).where(leases.c.sink_id == sid).order_by(leases.c.id))],
                transactional_ids=[repo.as_transactional_id(r) for r in conn.execute(
                    select(transactional_ids).where(transactional_ids.c.sink_id == sid).order_by(transactional_ids.c.id))],
                alerts=[Alert(r.id, r.sink_id, r.checkpoint_id, r.kind, r.at) for r in conn.execute(
                    select(events.c.id, events.c.sink_id, events.c.checkpoint_id, events.c.kind, events.c.at)
                    .where(events.c.sink_id == sid, events.c.kind.in_(repo.ALERT_KINDS)).order_by(events.c.id))],
            )

    def check_db(self, *, settled: bool, when: str) -> None:
        snap = self.snapshot()
        found = check_invariants(snap, settled=settled)
        found += check_no_quick_reuse(snap, timedelta(milliseconds=self.executor_init_reach_ms(self.limits)))
        if self._last_snapshot is not None:
            found += check_committed_unchanged(self._last_snapshot, snap)
        with self.engine.connect() as conn:  # the storage layout: a first try is in one place only
            found += [Violation("S1", f"attempt {a}'s first tries are both on its row and lease rows")
                      for a in repo.first_tries_in_two_places(conn, self.sink_id)]
        self._last_snapshot = snap
        self.violations += [f"{v} [{when}]" for v in map(str, found)]

    def cleanup(self) -> None:
        sid = self.sink_id
        if sid is None:
            return
        with self.engine.begin() as conn:
            for table in (events, lease_rows, transactional_ids, attempts, checkpoints, generations):
                conn.execute(delete(table).where(table.c.sink_id == sid))
            conn.execute(delete(sinks).where(sinks.c.id == sid))

    # --- the schedule -------------------------------------------------------------------------

    def run(self) -> ScheduleResult:
        self._release_leadership()  # leadership is per database: no schedule inherits another's
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
        return ScheduleResult(
            self.seed, self.violations, self.faults.counts, self.faults.fired_list, self.lines,
            self.n_batches, len(self.ckpt.commits),
        )

    def _run(self) -> None:
        spec = SinkSpec(self.sink, self.prefix, "model:9092", [self.topic], transaction_timeout_ms=self.timeout_ms,
                        commit_margin_ms=self.margin_ms)
        sink, _ = self.client.call("register_sink", lambda c: c.register_sink(spec, "sim"))
        self.sink_id = sink.id
        self.trace(f"schedule seed {self.seed}: {self.n_batches} batches, {len(self.replicas)} replica(s), "
                   f"inputs {[len(batch_input(self.seed, b)) for b in range(self.n_batches)]}")
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
        self.check()

    def quiesce(self) -> None:
        """Recovery until nothing is left to finish; I6 while transactions can still be open; then
        past every timeout, and recovery again."""
        self.fire_all_executor_zombies()
        self._release_leadership()
        self.every_recovery_loop("quiesce")
        self.finish_decided_commits("quiesce", 5)
        # I6 before the clock jump (after it the broker has expired everything): every transaction
        # still open under the prefix is one an unresolved lease explains
        unexplained = recovery_rules.lingering(self.model.list_open(self.prefix + "-"), self.snapshot().leases,
                                               include_completing=True)
        if unexplained:
            self.violations.append("I6: open transactions no unresolved lease explains after recovery: "
                                   f"{[self.local(t.transactional_id) for t in unexplained]}")
        self.trace("quiesce: clock moves past every transaction timeout")
        self.advance(self.timeout_ms + self.margin_ms)
        for _ in range(3):
            self.recovery_tick("quiesce", inject=False)

    def check(self) -> None:
        # I1-I4 (and L1) on the settled database; I1's history half against the earlier snapshots
        self.check_db(settled=True, when="after quiescence")
        # I6: nothing left open under the sink's prefix
        still_open = self.model.list_open(self.prefix + "-")
        if still_open:
            self.violations.append(f"I6: open transactions after recovery: {[self.local(t.transactional_id) for t in still_open]}")
        # I7: the read_committed view holds exactly the records of Spark's committed batches
        visible = Counter(self.model.read_committed(self.topic))
        expected = Counter(r for b in sorted(self.ckpt.commits) for r in self.ckpt.offsets[b])
        dup = sorted(r for r, n in visible.items() if n > 1)
        missing = sorted(set(expected) - set(visible))
        extra = sorted(set(visible) - set(expected))
        if dup:
            self.violations.append(f"I7: records visible more than once: {dup[:10]}")
        if missing:
            self.violations.append(f"I7: records of committed batches not visible: {missing[:10]}")
        if extra:
            self.violations.append(f"I7: records of uncommitted batches visible: {extra[:10]}")
        # loss is declared only when true, and in a correctly configured deployment never happens
        for cp in self.snapshot().checkpoints:
            if cp.state is CheckpointState.LOST:
                planned = self.ckpt.offsets.get(cp.batch_id, [])
                false = planned and all(visible[r] for r in planned)
                self.violations.append(f"{'FALSE LOST' if false else 'LOST'}: batch {cp.batch_id}: {cp.lost_reason}")
        if len(self.ckpt.commits) < self.n_batches:
            self.violations.append(f"LIVENESS: only {sorted(self.ckpt.commits)} of {self.n_batches} batches committed "
                                   "after the final fault-free restart")
        self.trace(f"end: spark committed {sorted(self.ckpt.commits)}, {sum(visible.values())} records visible")


_hooked: set[int] = set()


def prepare_engine(engine: Engine) -> None:
    """Install the statement hook through which faults fire inside the coordinator's operations."""
    if id(engine) in _hooked:
        return
    _hooked.add(id(engine))

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        sim = _current.get("sim")
        if sim is not None:
            sim.injector.on_statement()

    event.listen(engine, "before_cursor_execute", before)


_current: dict[str, Sim | None] = {"sim": None}


def run_schedules(engine: Engine, seeds: range | list[int], config: FaultConfig | None = None,
                  progress: Callable[[int, ScheduleResult], None] | None = None) -> list[ScheduleResult]:
    prepare_engine(engine)
    out = []
    for i, seed in enumerate(seeds):
        out.append(run_one(engine, seed, config))
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
    try:
        return _run_with_current(engine, seed, config, **kw)
    finally:
        _current["sim"] = None


def _run_with_current(engine: Engine, seed: int, config: FaultConfig | None, **kw: Any) -> tuple[ScheduleResult, Sim]:
    # a failing schedule's rows are deleted too (unless asked to keep them for inspection): a later
    # schedule's recovery loop would otherwise work on its sink, and no seed would replay alone
    keep = kw.pop("keep_on_failure", False)
    sim = Sim(seed, engine, config, **kw)
    _current["sim"] = sim
    try:
        result = sim.run()
    except Exception as exc:  # noqa: BLE001 - a crash of the simulation itself is a finding
        import traceback

        sim.violations.append(f"SIM: {type(exc).__name__}: {exc}")
        sim.trace(traceback.format_exc()[-3000:])
        result = ScheduleResult(seed, sim.violations, sim.faults.counts, sim.faults.fired_list, sim.lines,
                                sim.n_batches, len(sim.ckpt.commits))
    if result.ok or not keep:
        sim.cleanup()
    return result, sim
