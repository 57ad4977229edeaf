"""The coordinator's deployment in a schedule: its replicas (each a Coordinator and a recovery
loop over the one database, the Kafka model behind the fault hook), their clocks, and the client
the driver and the executors call them through."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from coordinator.protocol import errors as e
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from coordinator.service.recovery import RecoveryLoop

from .faults import ClientGaveUp, CoordinatorCrash, InjectedDbFailure
from .kafka_model import ModelControlPlane
from .virtual_time import VirtualPool

T = TypeVar("T")
RETRIABLE_UNAVAILABLE = {"kafka_commit_failed", e.POOL_EXHAUSTED}


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


class Replica:
    """One coordinator process (and its recovery loop) of the deployment."""

    def __init__(self, sim: Any, index: int) -> None:  # sim: the schedule (runner.Sim), which holds its replicas
        self.sim = sim
        self.index = index
        self.restarts = 0
        self.plane: ModelControlPlane
        self.coordinator: Coordinator
        self.loop: RecoveryLoop
        self.start()

    def start(self) -> None:
        sim = self.sim
        self.plane = ModelControlPlane(sim.model, hook=sim.injector.kafka_hook,
                                       retry_budget_ms=sim.limits.commit_reach.retry_budget_ms)  # type: ignore[union-attr]
        self.plane.unreachable = sim.unreachable
        self.coordinator = Coordinator(sim.engine, self.plane, clock=sim.replica_clock(self.index), limits=sim.limits)
        one = VirtualPool(1, sim.timeline(self))  # the broken variant: every step of every sink in turn
        self.loop = RecoveryLoop(self.coordinator, interval_ms=sim.reach.recovery_interval_ms,
                                 leader_ttl_ms=600_000, holder=f"sim-replica-{self.index}",
                                 finish_grace_ms=sim.recovery_grace_ms, sweep_interval_ms=0, workers=4,
                                 pool=lambda n, _name: one if sim.serial_recovery else VirtualPool(n, sim.timeline(self)))

    def restart(self) -> None:
        self.restarts += 1
        self.start()  # the dead object is dropped; its leadership row stays until it expires or is taken


class Client:
    """The coordinator client of the driver and the executors: retries the same request after a
    failure, a lost response or a 503, on whichever replica the load balancer picks."""

    def __init__(self, sim: Any) -> None:  # sim: the schedule (runner.Sim)
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
