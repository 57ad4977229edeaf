"""The fault vocabulary of the simulation and the injector that fires faults inside the
coordinator's operations (a database statement, a Kafka call).

Every decision comes from the schedule's one `random.Random(seed)`, consumed in program order
(the simulation is single-threaded), so a seed replays the same faults at the same steps.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from coordinator.kafka.control_plane import ControlPlaneError


class CoordinatorCrash(BaseException):
    """The coordinator process died mid-operation. A BaseException, like a real process death, so
    that no `except Exception` inside the service can swallow it."""


class InjectedDbFailure(Exception):
    """The database connection failed inside an operation, before its transaction committed."""


class DriverCrash(Exception):
    """The Spark driver died at a step."""


class TaskFailure(Exception):
    """An executor task failed (executor lost, producer error, refused call)."""


class ClientGaveUp(Exception):
    """The coordinator client ran out of retries."""


@dataclass
class FaultConfig:
    """Probabilities, each per opportunity (a step where that fault can happen)."""

    driver_crash: float = 0.035  # per driver step
    zombie_driver: float = 0.5  # of driver crashes: the old driver keeps calling (partitioned, not dead)
    executor_crash: float = 0.05  # per task step
    speculative_task: float = 0.15  # per task
    coordinator_crash: float = 0.04  # per API call / recovery iteration
    db_failure: float = 0.04  # per API call / recovery iteration
    request_fail: float = 0.03  # the request never reached the coordinator
    lost_response: float = 0.05  # applied, response lost: the client retries
    duplicate_request: float = 0.04  # the request is delivered twice
    kafka_fail: float = 0.04  # a control-plane call fails before the broker applied it
    kafka_lost_response: float = 0.04  # the broker applied it, the response was lost
    kafka_delay: float = 0.05  # the call is slow (the clock moves, well inside the margin)
    near_timeout: float = 0.07  # per task / commit: the clock jumps close to the transaction timeout
    recovery_tick: float = 0.2  # per driver step: a recovery-loop iteration runs now
    leader_failover: float = 0.2  # per recovery tick with two replicas: the leader steps down
    two_replicas: float = 0.5  # per schedule
    orphaned_commit: float = 0.05  # per commit: the driver dies with its commit in flight, and the replica
    #                                dies at one of its Kafka calls (after the decision, or before it)
    driver_down_long: float = 0.1  # per driver restart: the driver stays down past the transaction timeout,
    #                                so only the recovery loop finishes what it decided (within the commit reach)
    # issue 15's fault kinds
    zombie_executor: float = 0.04  # per task: the try stalls before InitProducerId, Spark re-runs it,
    #                               and its InitProducerId reaches the broker later (within the lease's init reach)
    clock_skew: float = 0.2  # per schedule: the second replica's clock is off, and may step back mid-run
    checkpoint_restore: float = 0.08  # per driver restart: Spark's checkpoint restored from an older backup
    kafka_unexpected_error: float = 0.05  # per commit call: UNKNOWN_SERVER_ERROR / an authorization failure
    end_txn_lost_reinit: float = 0.03  # per commit call: applied, answer lost, then the id initialised again
    stage_retry: float = 0.08  # per write job: stage attempt 0 is lost, its tries never ran, wrote, or stalled
    #                           as zombies; the resubmitted stage's tries look like first tries to themselves
    # issue 50's fault kinds (races.py)
    unreachable_neighbours: float = 0.2  # per schedule: other sinks on a cluster that answers nothing
    begin_race: float = 0.02  # per begin: the query restarts (a new generation) while the begin runs
    retire_race: float = 0.1  # per schedule, at its end: the sink is retired while a zombie's begin runs
    # not a fault: an operator's action
    history_prune: float = 0.2  # per recovery tick: the history of every committed batch but the newest is
    #                             pruned, a few batches at a time (no minimum age in the simulation)

    @classmethod
    def none(cls) -> FaultConfig:
        return cls(**{f.name: 0.0 for f in fields(cls)})

    def heavy(self, **overrides: float) -> FaultConfig:
        """The fault kinds of issues 15 and 50 at rates that fire in most schedules."""
        rates = dict(zombie_executor=0.08, clock_skew=0.3, checkpoint_restore=0.15, kafka_unexpected_error=0.1,
                     end_txn_lost_reinit=0.05, stage_retry=0.2, history_prune=0.3, unreachable_neighbours=0.5,
                     begin_race=0.05, retire_race=0.3, orphaned_commit=0.15, driver_down_long=0.2)
        return self.scaled(**{**rates, **overrides})

    def scaled(self, **overrides: float) -> FaultConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(overrides)
        return FaultConfig(**values)


@dataclass
class Faults:
    rng: random.Random
    config: FaultConfig
    enabled: bool = True
    counts: Counter[str] = field(default_factory=Counter)
    fired_list: list[str] = field(default_factory=list)

    def roll(self, kind: str) -> bool:
        p = getattr(self.config, kind)
        hit = self.rng.random() < p  # always consumed: the sequence does not depend on `enabled`
        return hit and self.enabled

    def fired(self, kind: str, detail: str = "") -> None:
        self.counts[kind] += 1
        self.fired_list.append(f"{kind}({detail})" if detail else kind)


class Injector:
    """Arms one fault for the duration of one coordinator operation: a crash or a connection
    failure at its k-th database statement, or a crash at its k-th Kafka call (before or after
    the broker applied it). Also the control plane's random faults (fail, lost response, delay)."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.armed: tuple[str, int, str] | None = None  # (kind, countdown, stage)
        self.kafka_faults = False
        self.dead = False  # the coordinator process crashed: nothing of this operation runs on

    def arm(self, kind: str, countdown: int, stage: str = "before") -> None:
        self.armed = (kind, countdown, stage)

    def disarm(self) -> None:
        self.armed = None
        self.kafka_faults = False
        self.dead = False

    def on_statement(self, *args: Any, **kwargs: Any) -> None:
        if self.dead:
            raise CoordinatorCrash(self.sim.op)
        if self.armed is None or self.armed[0] not in ("crash_db", "db_failure"):
            return
        kind, n, stage = self.armed
        if n > 1:
            self.armed = (kind, n - 1, stage)
            return
        self.armed = None
        if kind == "crash_db":
            self.dead = True
            self.sim.faults.fired("coordinator_crash", f"at db statement, {self.sim.op}")
            self.sim.trace(f"  !! coordinator crash at a db statement of {self.sim.op}")
            raise CoordinatorCrash(self.sim.op)
        self.sim.faults.fired("db_failure", self.sim.op)
        self.sim.trace(f"  !! db connection failure in {self.sim.op}")
        raise InjectedDbFailure(self.sim.op)

    def kafka_hook(self, stage: str, op: str, key: str) -> None:
        sim = self.sim
        if self.dead:
            raise CoordinatorCrash(op)
        if self.armed is not None and self.armed[0] == "crash_kafka" and self.armed[2] == stage:
            kind, n, st = self.armed
            if n > 1:
                self.armed = (kind, n - 1, st)
            else:
                self.armed = None
                self.dead = True
                sim.faults.fired("coordinator_crash", f"{stage} kafka {op}")
                sim.trace(f"  !! coordinator crash {stage} kafka {op} {sim.local(key)}")
                raise CoordinatorCrash(op)
        if not self.kafka_faults or op in ("list", "read_committed") and stage == "after":
            return
        f = sim.faults
        if op == "commit" and stage == "before" and f.roll("kafka_unexpected_error"):
            code = sim.rng.choice(["unknown_server_error", "transactional_id_authorization_failed", "kafka_error_4242"])
            f.fired("kafka_unexpected_error", code)
            sim.trace(f"  !! kafka commit {sim.local(key)} answered {code.upper()} (not applied)")
            raise ControlPlaneError(f"injected: EndTxn answered {code.upper()}", retriable=False, code=code)
        if op == "commit" and stage == "after" and f.roll("end_txn_lost_reinit"):
            f.fired("end_txn_lost_reinit", sim.local(key))
            sim.trace(f"  !! kafka commit {sim.local(key)} applied, answer lost; the id is initialised again")
            sim.model.init_producer_id(key, sim.timeout_ms)  # a late executor try, or a manual abort-transaction
            raise ControlPlaneError("injected: commit response lost", retriable=True, code="request_timed_out")
        if stage == "before":
            if f.roll("kafka_delay"):
                ms = sim.rng.randint(50, sim.small_delay_ms)
                f.fired("kafka_delay", f"{ms}ms")
                sim.advance(ms)
            if f.roll("kafka_fail"):
                f.fired("kafka_fail", op)
                sim.trace(f"  !! kafka {op} {sim.local(key)} failed before applying")
                raise ControlPlaneError(f"injected: {op} not sent", retriable=True, code="network_exception")
        elif f.roll("kafka_lost_response"):
            f.fired("kafka_lost_response", op)
            sim.trace(f"  !! kafka {op} {sim.local(key)} applied, response lost")
            raise ControlPlaneError(f"injected: {op} response lost", retriable=True, code="request_timed_out")
