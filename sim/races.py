"""Issue 50's fault kinds that need more than a roll of the dice:

- `unreachable_neighbours`: other sinks of the deployment sit on a Kafka cluster that answers
  nothing, each with a decided commit and aborts pending, while this schedule's own commits are
  orphaned (the deciding replica dies) or its driver stays down: the recovery loop must still
  finish them within their reach;
- `begin_racing_a_new_generation`: the driver's begin runs while the query restarts (a new
  generation fences it), the two in real concurrent transactions whose order only the
  database's locks decide: a fenced begin must leave no open attempt behind (F1);
- `retire_while_a_begin_runs`: an operator retires the sink while a (zombie) driver's begin runs:
  a retired sink must keep nothing open (F2).

The races run the begin in a second thread on its own engine, paused inside its transaction
right after its first statement (where it reads the sink) until the other call either finished
or is blocked; the schedule's fault hook fires on the schedule's own thread only."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.pool import NullPool

from coordinator.protocol import errors as e
from coordinator.protocol.model import PartitionResult, PrecommitRecord
from coordinator.service import Coordinator, SinkSpec

from .kafka_model import ModelControlPlane

DEAD_CLUSTER = "dead-cluster:9092"
_schedule_thread: list[int | None] = [None]


def on_the_schedules_thread() -> None:
    _schedule_thread[0] = threading.get_ident()


def is_main_thread() -> bool:
    """Whether this is the schedule's own thread (the fault hook fires there only)."""
    return _schedule_thread[0] in (None, threading.get_ident())


class RaceFaults:
    """A mixin of runner.Sim: the fault kinds above, on the schedule's state."""

    def unreachable_neighbours(self) -> None:
        if not self.faults.roll("unreachable_neighbours"):
            return
        n = self.rng.randint(4, 12)
        self.unreachable.add(DEAD_CLUSTER)
        self.faults.fired("unreachable_neighbours", str(n))
        self.trace(f"  !! {n} other sinks sit on a cluster that answers nothing, each with a decided commit")
        c = self.replicas[0].coordinator
        with self.operation("neighbours", inject=False):
            for i in range(n):
                name = f"a-dead-{self.sink}-{i:02}"  # sorted before the schedule's own sink
                spec = SinkSpec(name, f"dead{self.prefix}n{i}x", DEAD_CLUSTER, ["out"],
                                transaction_timeout_ms=self.timeout_ms, commit_margin_ms=self.margin_ms)
                sink, _ = c.register_sink(spec, "sim", check_broker=False)
                self.other_sinks.append(sink.id)
                gen, _ = c.start_generation(name, "q", "r", "sim")
                attempt = c.begin_checkpoint(name, 0, gen, "sim", partitions=2).attempt.number  # type: ignore[union-attr]
                won = c.begin_partition(name, 0, attempt, gen, 0, 1)
                c.begin_partition(name, 0, attempt, gen, 1, 2)  # a try that will not win: an abort pending
                try:
                    c.commit(name, 0, attempt, gen, [PartitionResult(0, won.id, PrecommitRecord(1, 7, 0, 1, 1)),
                                                     PartitionResult(1, None)], "sim")
                except e.Unavailable:
                    pass  # decided; its cluster never answers

    def _paused_begin(self, call: Callable[[Coordinator], Any]) -> tuple[threading.Thread, threading.Event,
                                                                                threading.Event, list[Any]]:
        """`call` on a coordinator of its own engine, in a thread, paused before its second statement."""
        engine = create_engine(self.engine.url, poolclass=NullPool)
        paused, resume, out = threading.Event(), threading.Event(), []
        seen = [0]

        def hold(*_: Any) -> None:
            seen[0] += 1
            if seen[0] == 2:
                paused.set()
                resume.wait(10)

        event.listen(engine, "before_cursor_execute", hold)
        plane = ModelControlPlane(self.model)
        coordinator = Coordinator(engine, plane, clock=self.replica_clock(0), limits=self.limits)

        def run() -> None:
            try:
                out.append(call(coordinator))
            except Exception as exc:  # noqa: BLE001 - its answer, whatever it is
                out.append(exc)
            finally:
                paused.set()
                engine.dispose()

        thread = threading.Thread(target=run, name="racing-begin", daemon=True)
        thread.start()
        paused.wait(10)
        return thread, resume, paused, out

    def _race(self, begin: Callable[[Coordinator], Any], other: Callable[[Coordinator], Any]) -> tuple[Any, Any]:
        """The begin paused inside its transaction, `other` run meanwhile in a thread; the begin resumes
        once `other` finished or has waited long enough to be blocked by it."""
        begun, resume, _, begin_out = self._paused_begin(begin)
        other_out: list[Any] = []

        def run_other() -> None:
            try:
                other_out.append(other(self.replicas[0].coordinator))
            except Exception as exc:  # noqa: BLE001
                other_out.append(exc)

        t = threading.Thread(target=run_other, name="racing-call", daemon=True)
        t.start()
        deadline = time.monotonic() + 0.3
        while t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        resume.set()
        begun.join(10)
        t.join(10)
        return (begin_out or [None])[0], (other_out or [None])[0]

    def begin_racing_a_new_generation(self, batch: int, generation: int, partitions: int, digest: str,
                                      run_id: str) -> None:
        """The driver's begin of `batch` races a restart of the query; the driver is fenced after it."""
        self.faults.fired("begin_race", f"b{batch} vs a new generation")
        begin_out, started = self._race(
            lambda c: c.begin_checkpoint(self.sink, batch, generation, "driver", partitions=partitions,
                                         offsets_digest=digest),
            lambda c: c.start_generation(self.sink, self.ckpt.query_id, f"{run_id}-restarted", "driver"))
        self.trace(f"  !! begin of batch {batch} raced a new generation: begin -> {_said(begin_out)}, "
                   f"new generation -> {_said(started)}")

    def retire_while_a_begin_runs(self) -> None:
        if not self.faults.config.retire_race or self.rng.random() >= self.faults.config.retire_race:
            return
        generation = self.sink_snapshot().sinks[0].generation
        self.faults.fired("retire_race")
        begin_out, retired = self._race(
            lambda c: c.begin_checkpoint(self.sink, self.n_batches, generation, "zombie", partitions=2),
            lambda c: c.retire_sink(self.sink, "operator", "the query was moved"))
        self.trace(f"  !! the sink was retired while a begin ran: begin -> {_said(begin_out)}, retire -> {_said(retired)}")


def _said(answer: Any) -> str:
    if isinstance(answer, e.ProtocolError):
        return f"{answer.status} {answer.reason}"
    if isinstance(answer, Exception):
        return f"{type(answer).__name__}: {answer}"
    return "ok"
