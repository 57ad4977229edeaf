"""Aborting an attempt (the driver gives up, or an operator does) and the aborts on Kafka that free
ids, through `Coordinator` (real Postgres, record-only Kafka, manual clock): the tries' leases are
aborted on Kafka and quarantined, unclaimed pre-leases freed at once; a retry answers the same;
two finishers aborting one lease never fence an id leased again."""

from __future__ import annotations

import threading

from sqlalchemy import Engine

from coordinator.kafka.control_plane import RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.states import AttemptState, LeaseState
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from fixtures.protocol_calls import (  # noqa: F401 - fixtures
    ACTOR,
    NAME,
    QUARANTINE_MS,
    assert_invariants,
    claimed,
    counts,
    event_kinds,
    held,
    ids_of,
    invariants_hold_at_the_end,
    kafka_calls,
    lease_state,
    offline,
    quarantined,
    refused,
    start,
    won,
)


def test_an_abort_ends_the_tries_on_kafka_and_frees_unclaimed_pre_leases_at_once(
        coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3)
    tries = claimed(c, 0, 1, gen, 2)  # partition 2's try never asked
    copy = c.lease(NAME, 0, 1, gen, 0, 55).lease
    attempt, outcome = c.abort_attempt(NAME, 0, 1, gen, "driver_gave_up", ACTOR)
    assert attempt.state is AttemptState.ABORTED and attempt.abort_reason == "driver_gave_up"
    assert sorted(outcome.aborted) == ids_of([*tries, copy]) and outcome.pending == []
    assert sorted(t for _, t in kafka.aborts) == ids_of([*tries, copy])
    states = {x.partition * 100 + (x.task_attempt_id or 0): x.state for x in c.checkpoint_detail(NAME, 0).leases}
    assert set(states.values()) == {LeaseState.ABORTED} and len(states) == 4
    # the tries' ids are quarantined (a try may still reach the broker); the unclaimed one is not
    assert quarantined(c) == {x.ordinal for x in [*tries, copy]}
    assert held(c) == [] and "attempt_aborted" in event_kinds(c)
    assert_invariants(c, settled=True)


def test_an_abort_retried_answers_the_same_and_has_no_second_effect(
        coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    (z,) = claimed(c, 0, 1, gen, 1)
    first = c.abort_attempt(NAME, 0, 1, gen, "give_up", ACTOR)
    rows, calls, before = counts(c.engine), kafka_calls(kafka), c.snapshot()
    clock.advance(ms=5)
    assert c.abort_attempt(NAME, 0, 1, gen, "give_up", ACTOR) == first and first[1].aborted == [z.transactional_id]
    # an operator's abort (no generation) of the same attempt: the same answer
    assert c.abort_attempt(NAME, 0, 1, None, "operator", "admin") == first
    assert counts(c.engine) == rows and kafka_calls(kafka) == calls and c.snapshot() == before


def test_a_decided_or_fenced_attempt_cannot_be_aborted(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c)
    c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=1)
    (x,) = claimed(c, 0, 1, g1, 1)
    c.commit(NAME, 0, 1, g1, [won(x)], ACTOR)
    refused(c, kafka, lambda: c.abort_attempt(NAME, 0, 1, g1, "late", ACTOR), e.COMMIT_DECIDED)
    refused(c, kafka, lambda: c.abort_attempt(NAME, 0, 1, None, "late", "admin"), e.COMMIT_DECIDED)
    c.begin_checkpoint(NAME, 1, g1, ACTOR, partitions=1)
    g2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)
    refused(c, kafka, lambda: c.abort_attempt(NAME, 1, 1, g1, "zombie", ACTOR), e.STALE_GENERATION)


def test_pending_aborts_wait_for_a_control_plane(coordinator: Coordinator, offline: Coordinator,
                                                 kafka: RecordingControlPlane):
    gen = start(offline)
    offline.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    tries = claimed(offline, 0, 1, gen, 2)
    _, outcome = offline.abort_attempt(NAME, 0, 1, gen, "driver_gave_up", ACTOR)
    assert outcome.aborted == [] and sorted(outcome.pending) == ids_of(tries)
    assert {lease_state(offline, x.id) for x in tries} == {LeaseState.ABORTING}
    assert held(offline) == ids_of(tries) and quarantined(offline) == set()  # held until the abort is done
    assert sorted(coordinator.run_pending_aborts(NAME).aborted) == ids_of(tries)
    assert held(coordinator) == [] and quarantined(coordinator) == {x.ordinal for x in tries}
    assert_invariants(coordinator, settled=True)


class _GatedControlPlane(RecordingControlPlane):
    """Its aborts block until released, so a test can run another caller in between."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.log = log
        self.entered = threading.Event()
        self.release = threading.Event()

    def abort(self, target, transactional_id):  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.release.wait(10)
        super().abort(target, transactional_id)
        self.log.append(("abort", transactional_id))


def test_a_stale_abort_never_hits_a_re_leased_id(
    coordinator: Coordinator, offline: Coordinator, kafka: RecordingControlPlane, engine: Engine, clock: ManualClock
):
    """Two callers abort the same pending lease (say the recovery loop and a resume). Both may send
    the abort (each is harmless to the transaction it ends); the slow one's abort must not land
    after the id was leased again, or it would fence the new lease's transaction: the id stays
    out of the pool for a quarantine longer than any abort of it can take."""
    gen = start(offline)
    offline.begin_checkpoint(NAME, 0, gen, ACTOR)
    stale = offline.begin_partition(NAME, 0, 1, gen, 0, 1)
    _, outcome = offline.abort_attempt(NAME, 0, 1, gen, "driver_gave_up", ACTOR)
    assert outcome.pending == [stale.transactional_id]

    log: list[tuple[str, str]] = []
    gated = _GatedControlPlane(log)
    slow = Coordinator(engine, gated, clock=clock)
    worker = threading.Thread(target=slow.run_pending_aborts, args=(NAME,))
    try:
        worker.start()
        assert gated.entered.wait(10)  # the slow caller is inside its Kafka call
        fast = coordinator.run_pending_aborts(NAME)
        assert fast.aborted == [stale.transactional_id] and kafka.aborts == [(NAME, stale.transactional_id)]
        assert lease_state(coordinator, stale.id) is LeaseState.ABORTED
        coordinator.begin_checkpoint(NAME, 0, gen, ACTOR)
        fresh = [coordinator.begin_partition(NAME, 0, 2, gen, p, 10 + p) for p in range(2)]
        log.extend(("leased", x.transactional_id) for x in fresh)
        assert stale.transactional_id not in ids_of(fresh)  # quarantined
    finally:
        gated.release.set()
        worker.join(10)
        slow.close()
    assert not worker.is_alive()
    for i, (kind, tid) in enumerate(log):
        if kind == "abort":
            assert ("leased", tid) not in log[:i], log
    assert gated.aborts == [(NAME, stale.transactional_id)]
    assert lease_state(coordinator, stale.id) is LeaseState.ABORTED
    # the id is free again only after its quarantine, and the next lease reuses it
    assert coordinator.begin_partition(NAME, 0, 2, gen, 0, 98).transactional_id != stale.transactional_id
    clock.advance(ms=QUARANTINE_MS)
    assert coordinator.begin_partition(NAME, 0, 2, gen, 0, 99).transactional_id == stale.transactional_id
    assert coordinator.run_pending_aborts(NAME) == type(outcome)()
    assert_invariants(coordinator)
