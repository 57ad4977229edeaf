"""Simulated Spark Structured Streaming with a foreachBatch writer that uses the coordinator.

Driver (Spark's MicroBatchExecution rules): the offset log entry of batch N is written before
the batch runs, and only once batch N-1 is in the commit log; the commit log entry is written
after foreachBatch returned. On restart the last batch of the offset log without a commit-log
entry is replayed with the same input (the same records); otherwise the next batch starts. Any
exception from foreachBatch fails the query; the simulation restarts it (a new run, a new
generation). Spark's task attempt ids restart with each SparkContext (a new driver).

Executors: one task per partition with rows (an empty partition takes no lease and opens no
transaction); failed tasks are retried up to spark.task.maxFailures; a task may get a
speculative copy, and the first copy to finish wins; a stage may be resubmitted (a fetch
failure), its tries running again while the old ones may still run; the number of partitions is
chosen anew for every job, so it changes between attempts and replays. The driver's begin names
the partition count and the batch's offsets (the coordinator takes an id per partition). Every
try with rows asks the coordinator for its lease with its task attempt id, as the real client
does: it sees no stage attempt number (PySpark's TaskContext has none), so it cannot tell a first
try from a try of a resubmitted stage; the coordinator can (the first asker claims the
partition's pre-lease, every other try gets its own id). A task refuses to initialise a producer
on a lease older than the coordinator's bound (the answer's age plus its own elapsed time),
initialises one on its id (InitProducerId on the model), produces its rows, checks its deadline
against the commit margin, and returns its pre-commit record (task try, producer id, epoch,
counts, first offsets) to the driver, which commits with them.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from datetime import timedelta
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from coordinator.protocol import errors as e
from coordinator.protocol.model import PartitionResult, PrecommitRecord

from coordinator.service import Coordinator, Limits
from coordinator.service.clock import ManualClock

from .faults import ClientGaveUp, DriverCrash, Faults, TaskFailure
from .kafka_model import KafkaError, KafkaModel

T = TypeVar("T")

MAX_TASK_FAILURES = 4  # spark.task.maxFailures
KAFKA_PARTITIONS = 3


def offsets_digest(records: list[str]) -> str:
    """What the driver's begin names: a digest of the batch's planned input (Spark's offsets entry)."""
    return "sha256:" + hashlib.sha256("\n".join(records).encode()).hexdigest()


def batch_input(seed: int, batch_id: int) -> list[str]:
    """The deterministic input of a batch (Spark replays it with the same offsets): unique ids."""
    rng = random.Random(seed * 7919 + batch_id)
    n = rng.choice([0, 1, 2, 3, 4, 5, 6, 8, 11])
    return [f"b{batch_id}r{i}" for i in range(n)]


@dataclass
class CheckpointLocation:
    """Spark's checkpoint directory: the query id (metadata), offset log and commit log."""

    query_id: str
    offsets: dict[int, list[str]] = field(default_factory=dict)
    commits: set[int] = field(default_factory=set)


class JobFailed(Exception):
    pass


@dataclass
class ZombieState:
    """What a driver that was presumed dead (but kept running) still knows."""

    generation: int
    batch_id: int | None = None
    attempt: int | None = None
    lease_ids: list[int] = field(default_factory=list)


class CoordinatorCalls(Protocol):
    def call(self, name: str, fn: Callable[[Coordinator], T], *, retries: int = 12) -> T: ...


class SimWorld(Protocol):
    """What simulated Spark sees of the schedule it runs in (runner.Sim is one): the coordinator
    through its client, the Kafka model, the shared clock, the fault dice and the trace. Declared
    here, where it is used, so that spark.py does not import the runner that drives it."""

    sink: str
    topic: str
    timeout_ms: int
    margin_ms: int
    n_batches: int
    limits: Limits
    rng: random.Random
    faults: Faults
    clock: ManualClock
    model: KafkaModel
    client: CoordinatorCalls
    ckpt: CheckpointLocation
    guessed_first_tries: bool

    def trace(self, line: str) -> None: ...
    def local(self, key: str) -> str: ...
    def locals(self, keys: list[str]) -> list[str]: ...
    def local_lease(self, lease_id: int | None) -> str | None: ...
    def advance(self, ms: int) -> None: ...
    def plan_input(self, batch: int) -> list[str]: ...
    def recovery_tick(self, why: str, *, inject: bool = True) -> None: ...
    def maybe_near_timeout(self, where: str, *, task: bool = False) -> None: ...
    def on_generation_started(self, driver: Driver) -> None: ...
    def executor_zombie(self, transactional_id: str, rows: list[str]) -> None: ...
    def orphan_call(self, name: str, fn: Callable[[Coordinator], Any]) -> None: ...
    def race_begin(self, batch: int, generation: int, partitions: int, digest: str, run_id: str) -> None: ...


class Driver:
    def __init__(self, sim: SimWorld, run_number: int) -> None:
        self.sim = sim
        self.run_id = f"run-{run_number}"
        self.generation: int | None = None
        self.task_attempt_ids = 0
        self.zombie = ZombieState(-1)

    def crash_point(self, where: str) -> None:
        sim = self.sim
        if sim.faults.roll("recovery_tick"):
            sim.recovery_tick(f"at driver {where}")
        if sim.faults.roll("driver_crash"):
            sim.faults.fired("driver_crash", where)
            sim.trace(f"  !! driver crash at {where}")
            raise DriverCrash(where)

    def run(self) -> None:
        sim = self.sim
        ckpt = sim.ckpt
        gen, aborts = sim.client.call(
            "start_generation", lambda c: c.start_generation(sim.sink, ckpt.query_id, self.run_id, "driver"))
        self.generation = gen
        self.zombie = ZombieState(gen)
        sim.trace(f"driver {self.run_id}: generation {gen}, fenced {sim.locals(aborts.aborted)}")
        sim.on_generation_started(self)
        while True:
            unfinished = [b for b in ckpt.offsets if b not in ckpt.commits]
            batch = max(unfinished) if unfinished else max(ckpt.commits, default=-1) + 1
            if batch >= sim.n_batches:
                return
            if batch not in ckpt.offsets:
                self.crash_point(f"batch {batch} before offset log")
                ckpt.offsets[batch] = sim.plan_input(batch)
            else:
                sim.trace(f"driver replays batch {batch}")
            self.crash_point(f"batch {batch} after offset log")
            self.foreach_batch(batch, list(ckpt.offsets[batch]))
            self.crash_point(f"batch {batch} before commit log")
            ckpt.commits.add(batch)
            sim.trace(f"driver: batch {batch} in the commit log")

    def foreach_batch(self, batch: int, records: list[str]) -> None:
        sim = self.sim
        gen = self.generation
        assert gen is not None
        self.zombie.batch_id, self.zombie.attempt, self.zombie.lease_ids = batch, None, []
        n = sim.rng.randint(1, 4)  # the job's partition count, known to the driver before it begins
        digest = offsets_digest(records)
        if sim.faults.roll("begin_race"):  # the query restarts while this begin runs: this driver is fenced
            sim.race_begin(batch, gen, n, digest, self.run_id)
            raise DriverCrash(f"batch {batch} begin raced a new generation")
        r = sim.client.call("begin_checkpoint", lambda c: c.begin_checkpoint(
            sim.sink, batch, gen, "driver", partitions=n, offsets_digest=digest))
        sim.trace(f"begin batch {batch}: {r.action} attempt {r.attempt.number if r.attempt else None}")
        if not r.must_write:
            return
        assert r.attempt is not None
        attempt = r.attempt.number
        self.zombie.attempt = attempt
        self.crash_point(f"batch {batch} after begin")
        results = self.run_job(batch, attempt, records, n)
        self.crash_point(f"batch {batch} job done")
        sim.maybe_near_timeout(f"before commit of batch {batch}")

        def commit(c: Coordinator) -> Any:
            return c.commit(sim.sink, batch, attempt, gen, results, "driver")

        if sim.faults.roll("orphaned_commit"):
            sim.orphan_call(f"commit of batch {batch}", commit)
            raise DriverCrash(f"batch {batch} commit in flight")
        sim.client.call("commit", commit)
        sim.trace(f"committed batch {batch} attempt {attempt}: {[(p.partition, sim.local_lease(p.lease_id)) for p in results]}")

    # --- the job ----------------------------------------------------------------------------

    def run_job(self, batch: int, attempt: int, records: list[str], n: int) -> list[PartitionResult]:
        sim = self.sim
        parts = [[r for i, r in enumerate(records) if i % n == p] for p in range(n)]
        sim.trace(f"job batch {batch} attempt {attempt}: {n} partitions {[len(p) for p in parts]}")
        if sim.faults.roll("stage_retry"):
            self.lose_stage_attempt(batch, attempt, parts)
        results = []
        for p, rows in enumerate(parts):
            if not rows:
                results.append(PartitionResult(p, None))
                continue
            lease_id, record = self.run_task_set(batch, attempt, p, rows)
            results.append(PartitionResult(p, lease_id, record))
        return results

    def lose_stage_attempt(self, batch: int, attempt: int, parts: list[list[str]]) -> None:
        """Spark resubmits the whole stage (a fetch failure): stage attempt 0's tries are given up on,
        each having never started, written (its result thrown away: an open transaction the commit
        must abort), or stalled after its lease and before InitProducerId (a zombie whose
        InitProducerId lands later). The resubmitted stage's tries look like first tries to
        themselves (no stage attempt number): only the coordinator's claim tells them apart."""
        sim = self.sim
        sim.faults.fired("stage_retry", f"b{batch}")
        sim.trace(f"  !! stage attempt 0 of batch {batch} is lost: the stage re-runs")
        for p, rows in enumerate(parts):
            if not rows:
                continue
            fate = sim.rng.choice(("never ran", "wrote", "stalled"))
            self.task_attempt_ids += 1
            if fate == "never ran":
                continue
            try:
                self.run_task(batch, attempt, p, self.task_attempt_ids, rows, stall=fate == "stalled", attempt_number=0)
                sim.trace(f"  stage attempt 0's try of p{p} finished; its result is thrown away")
            except TaskFailure as exc:
                sim.trace(f"  stage attempt 0's try of p{p}: {exc}")

    def run_task_set(self, batch: int, attempt: int, partition: int, rows: list[str]) -> tuple[int, PrecommitRecord]:
        sim = self.sim
        for failure in range(MAX_TASK_FAILURES):
            copies = 1
            if sim.faults.roll("speculative_task"):
                sim.faults.fired("speculative_task", f"b{batch} p{partition}")
                copies = 2
            winners = []
            for copy in range(copies):
                self.task_attempt_ids += 1
                try:
                    winners.append(self.run_task(batch, attempt, partition, self.task_attempt_ids, rows,
                                                 attempt_number=failure + copy))
                except TaskFailure as exc:
                    sim.trace(f"  task b{batch} p{partition} t{self.task_attempt_ids} failed: {exc}")
            if winners:
                return sim.rng.choice(winners)  # the first copy to finish wins
        raise JobFailed(f"partition {partition} of batch {batch} failed {MAX_TASK_FAILURES} times")

    def run_task(self, batch: int, attempt: int, partition: int, task_attempt_id: int, rows: list[str], *,
                 attempt_number: int, stall: bool = False) -> tuple[int, PrecommitRecord]:
        """One task try. `attempt_number`: what TaskContext.attemptNumber() says (0 for a partition's
        first try in every stage attempt, a resubmitted stage's included)."""
        sim = self.sim
        gen = self.generation
        assert gen is not None
        if sim.guessed_first_tries and attempt_number == 0:  # the broken variant (broken.py): the landed
            task_attempt_id = -1  # client named every try of attempt number 0 "the first try"

        def step(where: str) -> None:
            sim.advance(sim.rng.randint(0, 60))
            if sim.faults.roll("executor_crash"):
                sim.faults.fired("executor_crash", where)
                raise TaskFailure(f"executor lost {where}")

        try:
            grant = sim.client.call("lease", lambda c: c.lease(sim.sink, batch, attempt, gen, partition, task_attempt_id))
        except e.ProtocolError as exc:
            raise TaskFailure(f"lease refused: {exc.reason}") from exc
        except ClientGaveUp as exc:
            raise TaskFailure(str(exc)) from exc
        lease = grant.lease
        answered = sim.clock.now()  # the task's own (monotonic) clock from here on
        self.zombie.lease_ids.append(lease.id)
        sim.trace(f"  task b{batch} p{partition} t{task_attempt_id}: lease {sim.local_lease(lease.id)} "
                  f"{sim.local(lease.transactional_id)}")
        if stall or sim.faults.roll("zombie_executor"):  # stalls before InitProducerId; Spark gives up on it
            sim.executor_zombie(lease.transactional_id, rows)
            raise TaskFailure("executor stalled before init_transactions (its InitProducerId is still on its way)")
        step("after lease")
        # no InitProducerId on a lease older than the bound: its age when answered (the coordinator's
        # clock) plus the time since, by the task's own clock (its id may be out of quarantine and re-leased)
        age = timedelta(milliseconds=grant.age_ms) + (sim.clock.now() - answered)
        if age > timedelta(milliseconds=grant.rules.max_lease_init_age_ms):
            raise TaskFailure("lease too old to start init_transactions")
        try:
            pid, epoch = sim.model.init_producer_id(lease.transactional_id, sim.timeout_ms)
            step("after init_transactions")
            first: dict[tuple[str, int], int] = {}  # the transaction's first offset per partition
            for i, row in enumerate(rows):
                offset = sim.model.produce(lease.transactional_id, pid, epoch, sim.topic, kafka_partition(row), row)
                first.setdefault((sim.topic, kafka_partition(row)), offset)
                if i == 0:
                    step("mid produce")
        except KafkaError as exc:
            raise TaskFailure(f"producer: {exc.code}") from exc
        sim.maybe_near_timeout(f"task b{batch} p{partition} before its result", task=True)
        step("after flush")
        # the task's own deadline check (the coordinator's clock stands for the database's)
        if lease.deadline_at - sim.clock.now() < timedelta(milliseconds=sim.margin_ms):
            raise TaskFailure("transaction deadline inside the commit margin")
        step("after the result (result lost)")
        return lease.id, PrecommitRecord(task_attempt_id, pid, epoch, len(rows), sum(len(r) for r in rows),
                                         first_offsets=[[t, p, o] for (t, p), o in sorted(first.items())])


def kafka_partition(record: str) -> int:
    return sum(record.encode()) % KAFKA_PARTITIONS


def zombie_call(sim: SimWorld, z: ZombieState) -> tuple[str, Any]:
    """One call of a fenced driver (or its executors), chosen by the seed: (what, thunk)."""
    options: list[tuple[str, Any]] = []
    if z.batch_id is not None:
        b = z.batch_id
        options += [("begin_checkpoint", lambda c: c.begin_checkpoint(sim.sink, b, z.generation, "zombie"))] * 3
        if z.attempt is not None:
            a = z.attempt
            options.append(("lease", lambda c: c.lease(sim.sink, b, a, z.generation, 0, 10_000)))
            options.append(("commit", lambda c: c.commit(sim.sink, b, a, z.generation, [PartitionResult(0, None)], "zombie")))
            options.append(("abort_attempt", lambda c: c.abort_attempt(sim.sink, b, a, z.generation, "zombie", "zombie")))
            if z.lease_ids:
                lid = z.lease_ids[-1]
                options.append(("commit naming its lease", lambda c: c.commit(
                    sim.sink, b, a, z.generation, [PartitionResult(0, lid, PrecommitRecord(10_000, 1, 0, 1, 1))],
                    "zombie")))
    else:
        options.append(("begin_checkpoint", lambda c: c.begin_checkpoint(sim.sink, 0, z.generation, "zombie")))
    return sim.rng.choice(options)
