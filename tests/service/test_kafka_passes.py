"""The service's Kafka work as passes (commit_all, abort_all), through `Coordinator` on a real
Postgres: a pass stops starting calls once the broker answered none of them (the rest stay
pending for the next pass), a plane that makes whole passes gets each batch's winners or tries in
one pass and its outcomes decide, and a commit pass may retry only inside the commit's window,
counted from its decision (issue 50 §1)."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from coordinator.kafka.control_plane import NOT_TRIED, CallOutcome, ControlPlaneError, KafkaTarget, RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.configuration import CommitReach
from coordinator.protocol.states import CheckpointState, LeaseState
from coordinator.service import Coordinator, Limits
from coordinator.service.clock import ManualClock
from fixtures.protocol_calls import ACTOR, NAME, assert_invariants, claimed, ids_of, lease_state, start, won


def test_a_pass_over_kafka_stops_starting_calls_once_the_broker_answered_none(engine: Engine) -> None:
    """A broker that does not answer costs each call its whole retry budget: 4,096 winners, 16 at
    a time, would hold a commit call or the recovery loop for 34 minutes. Once one call got no
    answer and none got one, the calls not started yet are reported not tried (retriable: they stay
    pending for the next pass)."""
    unreachable = ControlPlaneError("broker down", retriable=True, code="broker_unreachable")
    kafka = RecordingControlPlane()
    c = Coordinator(engine, kafka, limits=Limits(kafka_parallelism=4))
    try:
        gen = start(c)
        c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=40)
        winners = claimed(c, 0, 1, gen, 40)
        kafka.fail_next(unreachable, times=1_000)
        with pytest.raises(e.Unavailable) as answer:
            c.commit(NAME, 0, 1, gen, [won(w) for w in winners], ACTOR)
        tried = 1_000 - len(kafka._failures)
        assert tried == 1  # the record-only plane makes its calls one after the other
        # the event and the answer name each tried call's error and count the others
        (failed,) = [ev for ev in c.list_events(NAME, limit=1000) if ev["kind"] == "commit_failed"]
        assert len(failed["detail"]["failures"]) == tried and failed["detail"]["not_tried"] == 40 - tried
        assert answer.value.detail["not_tried"] == 40 - tried and len(answer.value.detail["failures"]) == tried
        assert f"40 transaction(s) could not be committed on Kafka yet ({40 - tried} not tried" in answer.value.message
        assert {c.snapshot().leases[i].state for i in range(40)} == {LeaseState.COMMITTING}

        kafka.clear_failures()  # the broker is back: the next pass commits every winner
        assert c.resume(NAME, 0).checkpoint.state is CheckpointState.COMMITTED
        assert len(kafka.commits) == 40

        # an abort pass (a batch's 40 tries, the attempt given up) stops the same way
        c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=40)
        tries = claimed(c, 1, 1, gen, 40)
        kafka.fail_next(unreachable, times=1_000)
        _, outcome = c.abort_attempt(NAME, 1, 1, gen, "stage retry", ACTOR)
        tried = 1_000 - len(kafka._failures)
        assert tried == 1 and outcome.aborted == [] and len(outcome.pending) == 40
        (failed,) = [ev for ev in c.list_events(NAME, limit=1000) if ev["kind"] == "abort_failed"]
        assert len(failed["detail"]["failures"]) == tried and failed["detail"]["not_tried"] == 40 - tried
        kafka.clear_failures()
        assert sorted(c.run_pending_aborts(NAME).aborted) == ids_of(tries)
        assert_invariants(c, settled=True)
    finally:
        c.close()


class PassingPlane(RecordingControlPlane):
    """A control plane that makes whole passes (commit_all, abort_all), as the wire plane does:
    records each pass with its parallelism and budget and answers the outcomes queued in `answers`
    (else success)."""

    def __init__(self) -> None:
        super().__init__()
        self.passes: list[tuple[str, list[str], int, int | None]] = []
        self.answers: list[list[CallOutcome]] = []

    def _pass(self, kind: str, ids: list[str], parallelism: int, budget_ms: int | None) -> list[CallOutcome]:
        self.passes.append((kind, ids, parallelism, budget_ms))
        return self.answers.pop(0) if self.answers else [CallOutcome(None, 0.01) for _ in ids]

    def commit_all(self, target: KafkaTarget, txns, parallelism: int,  # type: ignore[no-untyped-def,override]
                   budget_ms: int | None = None) -> list[CallOutcome]:
        return self._pass("commit", [t.transactional_id for t in txns], parallelism, budget_ms)

    def abort_all(self, target: KafkaTarget, ids, parallelism: int,  # type: ignore[no-untyped-def,override]
                  budget_ms: int | None = None) -> list[CallOutcome]:
        return self._pass("abort", list(ids), parallelism, budget_ms)


REACH = CommitReach(request_timeout_ms=4_000, retry_budget_ms=8_000, leader_ttl_ms=6_000, recovery_interval_ms=2_000)


def test_a_plane_that_makes_passes_gets_each_pass_whole_and_its_outcomes_decide(
        engine: Engine, clock: ManualClock) -> None:
    """The service hands a batch's winners to commit_all in one call (and an attempt's tries to
    abort_all), and reads each transaction's outcome from the pass: one NOT_TRIED leaves its winner
    pending (the commit answers 503 and counts it), a later pass commits it. Each commit pass may
    retry only inside the commit's window counted from its decision (issue 50 §1), at least a
    request."""
    plane = PassingPlane()
    c = Coordinator(engine, plane, clock=clock, limits=Limits(kafka_parallelism=3, commit_reach=REACH))
    try:
        gen = start(c)
        c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=5)
        winners = claimed(c, 0, 1, gen, 5)
        not_tried = ControlPlaneError("not tried in this pass", retriable=True, code=NOT_TRIED)
        plane.answers.append([CallOutcome(None, 0.01)] * 4 + [CallOutcome(not_tried)])
        with pytest.raises(e.Unavailable) as answer:
            c.commit(NAME, 0, 1, gen, [won(w) for w in winners], ACTOR)
        # the deciding call's pass: the whole retry budget (the decision is this instant)
        assert plane.passes == [("commit", [w.transactional_id for w in winners], 3, REACH.retry_budget_ms)]
        assert plane.commits == [] and answer.value.detail["not_tried"] == 1
        assert [lease_state(c, w.id) for w in winners] == [LeaseState.COMMITTED] * 4 + [LeaseState.COMMITTING]
        clock.advance(ms=REACH.retry_window_ms - 7_000)  # 7 s of the window left: less than a budget
        with pytest.raises(e.Unavailable):
            plane.answers.append([CallOutcome(not_tried)])
            c.resume(NAME, 0)
        assert plane.passes[1] == ("commit", [winners[4].transactional_id], 3, 7_000)
        clock.advance(ms=6_000)  # 1 s left: a finisher still gets a request's time, no more
        assert c.resume(NAME, 0).checkpoint.state is CheckpointState.COMMITTED
        assert plane.passes[2] == ("commit", [winners[4].transactional_id], 3, REACH.request_timeout_ms)

        c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=4)
        tries = claimed(c, 1, 1, gen, 4)
        _, outcome = c.abort_attempt(NAME, 1, 1, gen, "stage retry", ACTOR)
        assert plane.passes[3] == ("abort", [x.transactional_id for x in tries], 3, None)
        assert plane.aborts == [] and sorted(outcome.aborted) == ids_of(tries)
        assert_invariants(c, settled=True)
    finally:
        c.close()
