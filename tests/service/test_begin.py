"""Begin checkpoint through `Coordinator` (real Postgres, record-only Kafka, manual clock): the
driver's first call of a batch answers skip, resume or write; a write answer takes one pre-lease
per partition with the attempt, in one transaction; a retried begin answers the same; a begin
over other offsets is refused loudly; one micro-batch is in flight per query; fenced and stale
drivers change nothing (I5)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from coordinator.http.schemas import BeginOut
from coordinator.kafka.control_plane import RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import AttemptState, CheckpointState, LeaseState
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from fixtures.protocol_calls import (  # noqa: F401 - fixtures
    ACTOR,
    MARGIN_MS,
    NAME,
    PREFIX,
    assert_invariants,
    claimed,
    counts,
    event_kinds,
    held,
    ids_of,
    invariants_hold_at_the_end,
    kafka_calls,
    pools,
    refused,
    start,
    won,
)


def test_begin_takes_a_pre_lease_per_partition_with_the_attempt(coordinator: Coordinator,
                                                               kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    gen = start(c)
    begun = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3)
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.attempt.partitions == 3 and begun.pre_leased == 3
    assert begun.lease_rules is not None and begun.lease_rules.commit_margin_ms == MARGIN_MS
    assert (begun.lease_rules.max_lease_init_age_ms, begun.lease_rules.producer_init_timeout_ms,
            begun.lease_rules.producer_request_timeout_ms) == (30_000, 60_000, 60_000)
    pre = sorted(c.checkpoint_detail(NAME, 0).leases, key=lambda x: x.partition)
    # durable with the attempt: each id held by its pre-lease (I3) before any producer exists
    assert [(x.partition, x.state, x.task_attempt_id) for x in pre] == [
        (p, LeaseState.PRELEASED, None) for p in range(3)]
    assert [x.transactional_id for x in pre] == [f"{PREFIX}-{p}" for p in range(3)]
    assert {(x.taken_at, x.leased_at) for x in pre} == {(clock.now(), clock.now())}
    assert held(c) == ids_of(pre)
    assert pools(c.engine)[0][1:] == (3, 0)  # the pool grew to 3, its cursor wrapped
    assert kafka_calls(kafka) == (0, 0)
    assert_invariants(c)


def test_a_retried_begin_answers_the_same_and_has_no_second_effect(coordinator: Coordinator, clock: ManualClock):
    c = coordinator
    gen = start(c)
    first = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3, offsets_digest="sha256:0000")
    before, rows = c.snapshot(), counts(c.engine)
    clock.advance(ms=5)
    again = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3, offsets_digest="sha256:0000")
    assert again.action is BeginAction.CONTINUE and again.must_write
    assert again.attempt == first.attempt and again.checkpoint == first.checkpoint
    assert c.snapshot() == before and counts(c.engine) == rows
    assert BeginOut.of(again) == BeginOut.of(first)  # the driver cannot tell a retry's answer apart


def test_a_begin_without_a_partition_count_takes_no_pre_leases(coordinator: Coordinator):
    c = coordinator
    gen = start(c)
    begun = c.begin_checkpoint(NAME, 0, gen, ACTOR)
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.pre_leased == 0 and begun.attempt.partitions is None
    assert held(c) == []
    # each try then gets an id of its own
    x = c.lease(NAME, 0, 1, gen, 0, 7).lease
    assert x.state is LeaseState.LEASED and x.task_attempt_id == 7 and x.transactional_id == f"{PREFIX}-0"


def test_a_begin_the_pool_cannot_serve_changes_nothing(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c, max_pool_size=2)
    err = refused(c, kafka, lambda: c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3), e.POOL_EXHAUSTED,
                  e.Unavailable)
    assert err.status == 503 and err.detail == {"asked": 3, "free": 2, "max_pool_size": 2}
    assert c.list_checkpoints(NAME) == []  # not even the checkpoint: one transaction
    assert c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2).pre_leased == 2


def test_begin_of_another_batch_supersedes_the_open_attempt(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    (x,) = claimed(c, 0, 1, gen, 1)  # partition 0's try claimed; partition 1's pre-lease unclaimed
    c.begin_checkpoint(NAME, 1, gen, ACTOR)  # one micro-batch in flight per query
    d = c.checkpoint_detail(NAME, 0)
    assert d.attempts[0].state is AttemptState.ABORTED and d.attempts[0].abort_reason == "superseded"
    assert {y.partition: y.state for y in d.leases} == {0: LeaseState.ABORTED, 1: LeaseState.ABORTED}
    assert kafka.aborts == [(NAME, x.transactional_id)]  # the unclaimed pre-lease needed no abort
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [won(x)], ACTOR), e.ATTEMPT_ABORTED)


def test_a_restarted_driver_begins_a_new_attempt_and_is_told_what_was_aborted(
        coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c)
    c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=3)
    tries = claimed(c, 0, 1, g1, 2)
    g2, fenced = c.start_generation(NAME, "q1", "r2", ACTOR)
    assert sorted(fenced.aborted) == ids_of(tries) and fenced.pending == []  # pre-leases no try claimed: none
    begun = c.begin_checkpoint(NAME, 0, g2, ACTOR, partitions=3)
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.attempt.number == 2
    assert sorted(begun.older_aborted) == ids_of(tries) and begun.older_abort_pending == []
    assert begun.pre_leased == 3


# --- fencing (I5) ------------------------------------------------------------------------------


def test_a_fenced_or_unknown_generation_cannot_begin(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c)
    g2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)
    c.begin_checkpoint(NAME, 0, g2, ACTOR, partitions=2)
    err = refused(c, kafka, lambda: c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=2), e.STALE_GENERATION)
    assert err.detail == {"current_generation": g2, "given_generation": g1}
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 1, g1, ACTOR), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 0, g2 + 1, ACTOR), e.UNKNOWN_GENERATION)
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 0, g2, ACTOR, partitions=257), "partition_out_of_range",
            e.Invalid)


# --- a batch is its offsets ------------------------------------------------------------------


def _mismatches() -> float:
    return REGISTRY.get_sample_value("coordinator_offsets_mismatch_total", {"sink": NAME}) or 0.0


def test_a_begin_over_other_offsets_is_refused_loudly(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1, offsets_digest="sha256:aaaa")
    (x,) = claimed(c, 0, 1, gen, 1)
    c.commit(NAME, 0, 1, gen, [won(x)], ACTOR)
    # the query restarts from a checkpoint location restored from an older backup: same query id,
    # batch 0 re-planned over other offsets. Skipping it as committed would lose the new data.
    gen2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)
    seen, rows = _mismatches(), counts(c.engine)
    before = c.snapshot()
    try:
        c.begin_checkpoint(NAME, 0, gen2, ACTOR, partitions=1, offsets_digest="sha256:bbbb")
    except e.Conflict as refused_:
        refusal = refused_
    else:
        raise AssertionError("a begin over other offsets was accepted")
    assert refusal.reason == e.OFFSETS_MISMATCH and refusal.status == 409
    assert refusal.detail["bound_digest"] == "sha256:aaaa"
    assert "lineage/reset" in refusal.message
    assert _mismatches() == seen + 1
    # loud: the audit trail says so; nothing else changed
    assert event_kinds(c)[-1] == "offsets_mismatch"
    assert c.snapshot() == before and counts(c.engine)["events"] == rows["events"] + 1
    # the same offsets (a plain replay) skip as before
    assert c.begin_checkpoint(NAME, 0, gen2, ACTOR, offsets_digest="sha256:aaaa").action is BeginAction.SKIP
    # an open batch is bound too: its replay over other offsets is refused, not continued
    c.begin_checkpoint(NAME, 1, gen2, ACTOR, partitions=1, offsets_digest="sha256:cccc")
    try:
        c.begin_checkpoint(NAME, 1, gen2, ACTOR, partitions=1, offsets_digest="sha256:dddd")
    except e.Conflict as open_refused:
        assert open_refused.reason == e.OFFSETS_MISMATCH
    else:
        raise AssertionError("an open batch's begin over other offsets was continued")
    assert_invariants(c)


def _unchecked() -> float:
    return REGISTRY.get_sample_value("coordinator_offsets_unchecked_total", {"sink": NAME}) or 0.0


def test_a_replay_whose_offsets_cannot_be_checked_is_said_loudly(coordinator: Coordinator,
                                                                 kafka: RecordingControlPlane,
                                                                 caplog: pytest.LogCaptureFixture):
    """Issue 50 §5: a begin without a digest (the writer's offsets.binding=off) is the
    user's choice; when the batch is begun again and either begin had no digest, the replay goes
    unchecked, and the coordinator says so (event, counter, warning) instead of accepting quietly."""
    c = coordinator
    gen = start(c)
    seen = _unchecked()
    c.begin_checkpoint(NAME, 0, gen, ACTOR, offsets_digest="sha256:aaaa")
    c.begin_checkpoint(NAME, 0, gen, ACTOR, offsets_digest="sha256:aaaa")  # a checked replay: quiet
    assert _unchecked() == seen and "offsets_unchecked" not in event_kinds(c)
    c.begin_checkpoint(NAME, 1, gen, ACTOR)  # a first begin without one: the writer logged the choice
    assert _unchecked() == seen and "offsets_unchecked" not in event_kinds(c)
    with caplog.at_level("WARNING", logger="coordinator"):
        c.begin_checkpoint(NAME, 1, gen, ACTOR, offsets_digest="sha256:bbbb")  # begun before without one
        c.begin_checkpoint(NAME, 0, gen, ACTOR)  # bound, but this begin names none
    assert _unchecked() == seen + 2
    assert event_kinds(c).count("offsets_unchecked") == 2
    assert sum("without its offsets checked" in r.getMessage() for r in caplog.records) == 2
    # the first digest named is bound all the same, and checks every later begin
    assert c.checkpoint_detail(NAME, 1).checkpoint.offsets_digest == "sha256:bbbb"
    with pytest.raises(e.Conflict) as refused:
        c.begin_checkpoint(NAME, 1, gen, ACTOR, offsets_digest="sha256:cccc")
    assert refused.value.reason == e.OFFSETS_MISMATCH
    assert_invariants(c)


def test_a_lost_and_acknowledged_batch_is_skipped_not_rewritten(coordinator: Coordinator, kafka: RecordingControlPlane):
    """Rewriting it would duplicate the partitions whose commits succeeded (tests/service/
    test_lost_data.py makes a batch LOST for real; the rule is rules.decide_begin)."""
    from coordinator.kafka.control_plane import ControlPlaneError

    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    (x,) = claimed(c, 0, 1, gen, 1)
    kafka.fail_next(ControlPlaneError("fenced", retriable=False, code="producer_fenced"))
    try:
        c.commit(NAME, 0, 1, gen, [won(x)], ACTOR)
    except e.Conflict as lost:
        assert lost.reason == e.DATA_LOST
    c.acknowledge_lost_data(NAME, "admin", "accepted")
    replay = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    assert replay.action is BeginAction.SKIP and replay.checkpoint.state is CheckpointState.LOST
    assert replay.pre_leased == 0 and held(c) == []
