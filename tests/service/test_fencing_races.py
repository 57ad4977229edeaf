"""Begin racing a new generation and retirement (issue 50 §3), on a real Postgres with two threads
and two connections. Begin locks the sink's row FOR SHARE, start_generation and retire lock it FOR
UPDATE, so they take turns whatever the order: a fenced driver's begin changes nothing, and a
retired sink keeps no open attempt or held id (F1, F2 of the invariant checker).

Each race is made deterministic: one operation is held inside its transaction (after its lock) by
a gate on a store call it makes; the other is started and seen waiting for a lock in
pg_stat_activity; then the gate opens."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Engine, text

from coordinator.kafka.control_plane import RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import AttemptState, LeaseState
from coordinator.service import Coordinator
from coordinator.store import events, leases
from fixtures.protocol_calls import ACTOR, NAME, held, invariants_hold_at_the_end, start  # noqa: F401 - fixtures


def waiting_for_a_lock(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )).scalar_one())


def until_one_waits_for_a_lock(engine: Engine, pending: Future[Any]) -> None:
    deadline = time.monotonic() + 30
    while waiting_for_a_lock(engine) < 1:
        assert not pending.done(), f"it did not wait for the lock: {pending.result()}"
        assert time.monotonic() < deadline, "it never waited for the lock"
        time.sleep(0.02)


class Gate:
    """Holds the first call that passes it until opened (the caller is then inside its transaction)."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.open = threading.Event()
        self._taken = False
        self._lock = threading.Lock()

    def pass_(self) -> None:
        with self._lock:
            first, self._taken = not self._taken, True
        if first:
            self.inside.set()
            assert self.open.wait(30), "the gate was never opened"


@contextmanager
def gated_event(monkeypatch: pytest.MonkeyPatch, kind: str) -> Iterator[Gate]:
    """Hold the operation that writes the event `kind`, right after writing it (its locks taken)."""
    gate, real = Gate(), events.add

    def add(conn: Any, sink_id: int, event_kind: str, *args: Any, **kw: Any) -> None:
        real(conn, sink_id, event_kind, *args, **kw)
        if event_kind == kind:
            gate.pass_()

    monkeypatch.setattr(events, "add", add)
    try:
        yield gate
    finally:
        gate.open.set()


@contextmanager
def gated_pre_leases(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    """Hold a begin right after it took its pre-leases (the sink's row locked FOR SHARE)."""
    gate, real = Gate(), leases.grant

    def grant(*args: Any, **kw: Any) -> Any:
        out = real(*args, **kw)
        gate.pass_()
        return out

    monkeypatch.setattr(leases, "grant", grant)
    try:
        yield gate
    finally:
        gate.open.set()


def race(engine: Engine, first: Callable[[], Any], gate: Gate, second: Callable[[], Any]) -> tuple[Future[Any], Future[Any]]:
    """`first` runs until its gate, `second` is started and seen waiting for a lock, the gate
    opens; both futures, done."""
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(first)
        assert gate.inside.wait(30), f"the first operation never reached its gate: {one.result() if one.done() else ''}"
        two = pool.submit(second)
        until_one_waits_for_a_lock(engine, two)
        assert not one.done()
        gate.open.set()
        one.exception(30), two.exception(30)
    return one, two


def no_violations(c: Coordinator) -> None:
    assert [str(v) for v in check_invariants(c.snapshot())] == []


# --- begin and a new generation ----------------------------------------------------------------


def test_a_fenced_drivers_begin_waits_for_the_new_generation_and_changes_nothing(
        coordinator: Coordinator, kafka: RecordingControlPlane, monkeypatch: pytest.MonkeyPatch):
    c = coordinator
    g1 = start(c)
    with gated_event(monkeypatch, "generation_started") as gate:
        fence, begin = race(c.engine, lambda: c.start_generation(NAME, "q1", "r2", ACTOR), gate,
                            lambda: c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=2))
    assert fence.result()[0] == g1 + 1
    refusal = begin.exception()
    assert isinstance(refusal, e.Conflict) and refusal.reason == e.STALE_GENERATION, refusal
    snap = c.snapshot()
    assert snap.checkpoints == [] and snap.attempts == [] and snap.leases == []
    assert kafka.aborts == []
    no_violations(c)


def test_a_begin_the_new_generation_waited_for_is_fenced_by_it(
        coordinator: Coordinator, kafka: RecordingControlPlane, monkeypatch: pytest.MonkeyPatch):
    c = coordinator
    g1 = start(c)
    with gated_pre_leases(monkeypatch) as gate:
        begin, fence = race(c.engine, lambda: c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=2), gate,
                            lambda: c.start_generation(NAME, "q1", "r2", ACTOR))
    begun, (g2, fenced) = begin.result(), fence.result()
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.pre_leased == 2 and g2 == g1 + 1
    # the new generation ended the attempt it waited for: no open attempt of a fenced generation (F1)
    d = c.checkpoint_detail(NAME, 0)
    assert d.attempts[0].state is AttemptState.ABORTED and d.attempts[0].abort_reason == f"fenced_by_generation_{g2}"
    assert {x.state for x in d.leases} == {LeaseState.ABORTED} and held(c) == []
    assert fenced.aborted == fenced.pending == [] and kafka.aborts == []  # no try had claimed them
    with pytest.raises(e.Conflict) as late:  # the fenced driver's executors
        c.lease(NAME, 0, begun.attempt.number, g1, 0, 1)
    assert late.value.reason == e.STALE_GENERATION
    no_violations(c)


# --- begin and retirement ----------------------------------------------------------------------


def test_a_begin_that_waited_for_a_retirement_is_refused(
        coordinator: Coordinator, kafka: RecordingControlPlane, monkeypatch: pytest.MonkeyPatch):
    c = coordinator
    gen = start(c)
    with gated_event(monkeypatch, "sink_retired") as gate:
        retire, begin = race(c.engine, lambda: c.retire_sink(NAME, "admin", "moved"), gate,
                             lambda: c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2))
    sink, retired_now = retire.result()
    assert retired_now and sink.retired_at is not None
    refusal = begin.exception()
    assert isinstance(refusal, e.Conflict) and refusal.reason == e.SINK_RETIRED, refusal
    snap = c.snapshot()
    assert snap.checkpoints == [] and snap.attempts == [] and snap.leases == []  # a retired sink holds nothing (F2)
    no_violations(c)


def test_a_retirement_that_waited_for_a_begin_is_blocked_by_it(
        coordinator: Coordinator, kafka: RecordingControlPlane, monkeypatch: pytest.MonkeyPatch):
    c = coordinator
    gen = start(c)
    with gated_pre_leases(monkeypatch) as gate:
        begin, retire = race(c.engine, lambda: c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2), gate,
                             lambda: c.retire_sink(NAME, "admin", "moved"))
    assert begin.result().action is BeginAction.NEW_ATTEMPT
    refusal = retire.exception()
    assert isinstance(refusal, e.Conflict) and refusal.reason == e.RETIREMENT_BLOCKED, refusal
    assert "1 undecided attempt(s)" in refusal.message and "2 transactional id(s)" in refusal.message
    assert c.get_sink(NAME).retired_at is None
    no_violations(c)
