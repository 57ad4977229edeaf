"""The schedule's faults that are about time and what it replays: true time moving on (with the
stalled executors' InitProducerIds landing on the way), replica clocks skewed or stepping back,
pauses close to the transaction timeout, a driver down past every timeout, and Spark's checkpoint
restored from an older backup. A mixin of runner.Sim, whose state it uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .kafka_model import KafkaError
from .spark import CheckpointLocation, batch_input, kafka_partition

# How late a stalled executor try's InitProducerId may still reach the broker after its lease was
# granted, where the coordinator states no bound of its own.
EXECUTOR_INIT_REACH_MS = 10_000


@dataclass
class ExecutorZombie:
    """A stalled executor try whose InitProducerId reaches the broker at `fire_at` (true time)."""

    fire_at: datetime
    transactional_id: str
    rows: list[str] = field(default_factory=list)


class TimeFaults:
    def __init__(self) -> None:
        self.executor_zombies: list[ExecutorZombie] = []
        self.restores = 0  # checkpoint restores from an older backup so far
        self.replanned: set[int] = set()  # batches whose committed plan the restore dropped
        self.newest_checkpoint: CheckpointLocation | None = None  # what the operator can put back

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

    def executor_init_reach_ms(self, limits: Any) -> int:
        """How late a stalled try's InitProducerId may land after its lease: the protocol's bound
        (lease age at init + init timeout + request timeout)."""
        parts = [getattr(limits, n, None) for n in
                 ("lease_max_init_age_ms", "producer_init_timeout_ms", "producer_request_timeout_ms")]
        return sum(parts) if all(p is not None for p in parts) else EXECUTOR_INIT_REACH_MS  # type: ignore[arg-type]

    def executor_zombie(self, transactional_id: str, rows: list[str]) -> None:
        delay = self.rng.randint(1, self.executor_init_reach_ms(self.limits))
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
                self.trace(f"  !! the stalled executor produced {len(z.rows)} record(s), never reported")
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
