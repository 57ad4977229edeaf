"""The protocol's checks and decisions (coordinator/protocol/rules.py), as pure functions over
plain records: generations and lineage, begin, the id pool and leases (pick_ids, decide_lease),
commit (plan_commit with its claim check and timeout gate), lost data and retirement. No
database, no clock, no network."""

from __future__ import annotations

import pytest

from coordinator.protocol import errors as e
from coordinator.protocol import rules
from coordinator.protocol.model import Checkpoint, IdPool, PartitionResult, PrecommitRecord
from coordinator.protocol.rules import BeginAction, LeaseAction
from coordinator.protocol.states import AttemptState, CheckpointState, LeaseState
from fixtures.protocol_records import (
    MARGIN_MS,
    T0,
    TIMEOUT_MS,
    attempt,
    checkpoint,
    decided,
    lease,
    ms,
    pre_lease,
    reason_of,
    record_for,
    sink,
)

NOW = T0 + ms(1_000)  # a second into the leases of these tests: far from their deadlines


# --- generations and lineage -----------------------------------------------------------------


def test_check_generation():
    rules.check_generation(3, 3)
    with pytest.raises(e.Conflict) as exc:
        rules.check_generation(3, 2)
    assert exc.value.reason == e.STALE_GENERATION and exc.value.status == 409
    assert exc.value.detail == {"current_generation": 3, "given_generation": 2}
    with pytest.raises(e.Conflict) as exc:
        rules.check_generation(3, 4)
    assert exc.value.reason == e.UNKNOWN_GENERATION


def test_check_lineage():
    rules.check_lineage(None, "q1")  # unbound: the first query binds
    rules.check_lineage("q1", "q1")
    with pytest.raises(e.Conflict) as exc:
        rules.check_lineage("q1", "q2")
    assert exc.value.reason == e.LINEAGE_MISMATCH
    assert exc.value.detail == {"bound_query_id": "q1", "query_id": "q2"}


# --- begin -----------------------------------------------------------------------------------


def test_decide_begin():
    open_g1 = attempt(generation=1)
    assert rules.decide_begin(CheckpointState.COMMITTED, open_g1, 1) is BeginAction.SKIP
    assert rules.decide_begin(CheckpointState.COMMITTED, None, 5) is BeginAction.SKIP
    # LOST (after an operator acknowledged it): rewriting would duplicate the partitions that committed
    assert rules.decide_begin(CheckpointState.LOST, None, 1) is BeginAction.SKIP
    assert rules.decide_begin(CheckpointState.COMMITTING, attempt(state=AttemptState.COMMITTING), 2) is BeginAction.RESUME
    assert rules.decide_begin(CheckpointState.OPEN, None, 1) is BeginAction.NEW_ATTEMPT
    assert rules.decide_begin(CheckpointState.OPEN, open_g1, 1) is BeginAction.CONTINUE
    # an open attempt of an older generation is not continued
    assert rules.decide_begin(CheckpointState.OPEN, open_g1, 2) is BeginAction.NEW_ATTEMPT
    # an aborted attempt of the same generation is not continued either
    aborted = attempt(generation=1, state=AttemptState.ABORTED, abort_reason="x")
    assert rules.decide_begin(CheckpointState.OPEN, aborted, 1) is BeginAction.NEW_ATTEMPT


def test_check_offsets():
    # a first begin is checked whatever it names (it binds what it names)
    assert rules.check_offsets(None, None, 3, replay=False)
    assert rules.check_offsets("sha256:a", "sha256:a", 3, replay=False)
    # a replay is checked only when both sides have a digest
    assert rules.check_offsets("sha256:a", "sha256:a", 3, replay=True)
    assert not rules.check_offsets(None, "sha256:a", 3, replay=True)  # begun before without one
    assert not rules.check_offsets("sha256:a", None, 3, replay=True)  # this begin names none
    assert not rules.check_offsets(None, None, 3, replay=True)
    for replay in (False, True):
        with pytest.raises(e.Conflict) as refused:
            rules.check_offsets("sha256:a", "sha256:b", 3, replay=replay)
        assert reason_of(refused) == e.OFFSETS_MISMATCH and refused.value.detail["batch_id"] == 3
        assert "lineage/reset" in refused.value.message


def test_check_attempt_writable():
    rules.check_attempt_writable(attempt(number=2, generation=3), current_attempt=2, generation=3)
    cases = [
        (attempt(generation=3), 1, 2, e.STALE_GENERATION),  # the caller is older than the attempt
        (attempt(generation=1), 1, 2, e.STALE_ATTEMPT),  # the attempt is older than the caller
        (attempt(number=1), 2, 1, e.STALE_ATTEMPT),  # superseded
        (attempt(state=AttemptState.ABORTED, abort_reason="r"), 1, 1, e.ATTEMPT_ABORTED),
        (attempt(state=AttemptState.COMMITTING), 1, 1, e.COMMIT_DECIDED),
        (attempt(state=AttemptState.COMMITTED), 1, 1, e.COMMIT_DECIDED),
    ]
    for a, current, gen, reason in cases:
        with pytest.raises(e.Conflict) as exc:
            rules.check_attempt_writable(a, current, gen)
        assert exc.value.reason == reason, (a, current, gen)


def test_check_partition():
    rules.check_partition(0, 4)
    rules.check_partition(3, 4)
    for p in (-1, 4, 100):
        with pytest.raises(e.Invalid) as exc:
            rules.check_partition(p, 4)
        assert reason_of(exc) == "partition_out_of_range"


# --- the id pool: pick_ids ---------------------------------------------------------------------


def pool(size: int, cursor: int = 0) -> IdPool:
    return IdPool(sink_id=1, size=size, cursor=cursor)


def test_pick_ids_goes_round_robin_from_the_cursor():
    picked = rules.pick_ids(pool(6, cursor=2), busy=set(), count=3, max_size=16)
    assert picked.ordinals == (2, 3, 4) and picked.pool == pool(6, cursor=5)
    # from the cursor to the end, then from the start: the least recently leased come first
    picked = rules.pick_ids(pool(6, cursor=5), busy=set(), count=3, max_size=16)
    assert picked.ordinals == (5, 0, 1) and picked.pool == pool(6, cursor=2)
    # the cursor after the last id of the pool wraps to 0
    assert rules.pick_ids(pool(6, cursor=4), set(), 2, 16).pool == pool(6, cursor=0)
    # a cursor beyond the size (never written so, but read defensively) starts from 0
    assert rules.pick_ids(pool(3, cursor=7), set(), 1, 16).ordinals == (0,)


def test_successive_picks_hand_out_every_free_id_before_any_again():
    state, seen = pool(5), []
    for _ in range(5):
        picked = rules.pick_ids(state, set(), 1, 5)
        seen += picked.ordinals
        state = picked.pool
    assert sorted(seen) == [0, 1, 2, 3, 4]
    assert rules.pick_ids(state, set(), 1, 5).ordinals == (seen[0],)


def test_pick_ids_skips_busy_ids():
    # busy: held by an unresolved lease, or quarantined (I3, no quick reuse)
    picked = rules.pick_ids(pool(6, cursor=1), busy={1, 2, 4}, count=2, max_size=6)
    assert picked.ordinals == (3, 5) and picked.pool == pool(6, cursor=0)
    picked = rules.pick_ids(pool(6, cursor=4), busy={4, 5, 0}, count=2, max_size=6)
    assert picked.ordinals == (1, 2) and picked.pool == pool(6, cursor=3)


def test_pick_ids_grows_the_pool_up_to_max_when_too_few_are_free():
    picked = rules.pick_ids(pool(2), busy={0, 1}, count=3, max_size=8)
    assert picked.ordinals == (2, 3, 4) and picked.pool == pool(5, cursor=0)
    # free ids first, then new ones
    picked = rules.pick_ids(pool(3, cursor=1), busy={2}, count=4, max_size=8)
    assert picked.ordinals == (1, 0, 3, 4) and picked.pool.size == 5
    # an empty pool (a new sink) grows from 0
    picked = rules.pick_ids(pool(0), set(), 3, 8)
    assert picked.ordinals == (0, 1, 2) and picked.pool == pool(3, cursor=0)
    # exactly up to max_size
    assert rules.pick_ids(pool(2), {0, 1}, 2, 4).pool.size == 4


def test_pick_ids_answers_pool_exhausted_past_max_size():
    with pytest.raises(e.Unavailable) as exc:
        rules.pick_ids(pool(2), busy={0, 1}, count=3, max_size=4)
    assert reason_of(exc) == e.POOL_EXHAUSTED and exc.value.status == 503
    assert exc.value.detail == {"asked": 3, "free": 2, "max_pool_size": 4}
    with pytest.raises(e.Unavailable) as exc:
        rules.pick_ids(pool(4), busy={0, 1, 2, 3}, count=1, max_size=4)  # every id busy, no room to grow
    assert exc.value.detail == {"asked": 1, "free": 0, "max_pool_size": 4}


def test_pick_ids_of_nothing_changes_nothing():
    picked = rules.pick_ids(pool(4, cursor=3), {0, 1, 2, 3}, 0, 4)
    assert picked.ordinals == () and picked.pool == pool(4, cursor=3)


# --- a try's lease: decide_lease -------------------------------------------------------------


def test_decide_lease_the_first_try_claims_the_pre_lease():
    assert rules.decide_lease(None, pre_lease()) is LeaseAction.CLAIM


def test_decide_lease_any_other_try_gets_its_own_id():
    # the pre-lease was claimed by another try (a retry, a speculative copy, a resubmitted stage's try)
    assert rules.decide_lease(None, None) is LeaseAction.GRANT
    # or ended with its attempt before any try asked
    assert rules.decide_lease(None, pre_lease(state=LeaseState.ABORTED, resolved_at=NOW)) is LeaseAction.GRANT
    # no pre-lease was taken (begin without a partition count)
    assert rules.decide_lease(None, None) is LeaseAction.GRANT


def test_decide_lease_a_try_that_asked_before_gets_the_same_lease():
    assert rules.decide_lease(lease(task_attempt_id=7), None) is LeaseAction.AGAIN
    # even one that claimed the pre-lease: its claim is its own lease now
    assert rules.decide_lease(lease(task_attempt_id=7), pre_lease(id=9)) is LeaseAction.AGAIN


@pytest.mark.parametrize("state", [LeaseState.COMMITTING, LeaseState.COMMITTED, LeaseState.ABORTING,
                                   LeaseState.ABORTED, LeaseState.LOST_ABORTING, LeaseState.LOST])
def test_decide_lease_refuses_a_try_whose_own_lease_has_ended(state):
    """A try's lease that is decided or aborted is not handed out again, and the try gets no
    second id either: its lease is stale."""
    with pytest.raises(e.Conflict) as exc:
        rules.decide_lease(lease(id=4, task_attempt_id=7, state=state), pre_lease(id=9))
    assert reason_of(exc) == e.STALE_LEASE
    assert exc.value.detail == {"lease_id": 4, "lease_state": str(state)}


# --- lease times -----------------------------------------------------------------------------


def test_transaction_deadline_and_remaining_time():
    assert rules.transaction_deadline(T0, 60_000) == T0 + ms(60_000)
    x = lease()
    assert rules.remaining_ms(x, T0 + ms(10_000)) == 50_000
    assert rules.deadline_too_close(x, T0 + ms(TIMEOUT_MS - MARGIN_MS), MARGIN_MS) is False  # exactly the margin
    assert rules.deadline_too_close(x, T0 + ms(TIMEOUT_MS - MARGIN_MS + 0.5), MARGIN_MS) is True  # sub-millisecond


def test_age_fraction():
    assert rules.transaction_age_fraction(lease(), T0 + ms(48_000), TIMEOUT_MS) == pytest.approx(0.8)


# --- commit: plan_commit ---------------------------------------------------------------------


def test_validate_partition_results():
    rules.validate_partition_results([], 4)
    rules.validate_partition_results([PartitionResult(1, None), PartitionResult(0, 5)], 4)
    for bad in (
        [PartitionResult(1, None)],  # 0 missing
        [PartitionResult(0, None), PartitionResult(2, None)],  # gap
        [PartitionResult(0, 1), PartitionResult(0, 2)],  # duplicate
        [PartitionResult(-1, None), PartitionResult(0, None)],
    ):
        with pytest.raises(e.Invalid) as exc:
            rules.validate_partition_results(bad, 4)
        assert exc.value.reason == "partitions_incomplete"
    with pytest.raises(e.Invalid) as exc:
        rules.validate_partition_results([PartitionResult(i, None) for i in range(5)], 4)
    assert exc.value.reason == "too_many_partitions"


def _attempt_leases():
    """An attempt of three partitions: partition 0's first try claimed the pre-lease and a
    speculative copy got its own id; partition 1's first try claimed; partition 2's pre-lease no
    try claimed (say it was empty), and its try that did ask failed; one more lease is already
    ABORTING."""
    return [
        lease(id=1, partition=0, task_attempt_id=10, ordinal=0),  # claimed pre-lease
        lease(id=2, partition=0, task_attempt_id=11, ordinal=1),  # speculative copy
        lease(id=3, partition=1, task_attempt_id=12, ordinal=2),  # claimed pre-lease
        pre_lease(id=4, partition=2, ordinal=3),  # no try claimed it
        lease(id=5, partition=2, task_attempt_id=13, ordinal=4),  # a try that failed, never reported
        lease(id=6, partition=2, task_attempt_id=14, ordinal=5, state=LeaseState.ABORTING),
    ]


def plan(results, leases=None, now=NOW, margin_ms=MARGIN_MS):
    return rules.plan_commit(_attempt_leases() if leases is None else leases, results, 8, now=now,
                             margin_ms=margin_ms)


def won(lease_id: int, partition: int, task: int) -> PartitionResult:
    x = lease(id=lease_id, task_attempt_id=task)
    return PartitionResult(partition, lease_id, record_for(x))


def test_plan_commit_chooses_winners_losers_and_unused_pre_leases():
    results = [won(2, 0, 11), won(3, 1, 12), PartitionResult(2, None)]
    p = plan(results)
    assert [(w.id, r) for w, r in p.winners] == [(2, results[0].precommit), (3, results[1].precommit)]
    # every lease a try held that did not win loses (aborted on Kafka, then quarantined); one
    # already ABORTING is not planned twice
    assert sorted(x.id for x in p.losers) == [1, 5]
    # the pre-lease no try claimed never had a producer: freed without Kafka
    assert [x.id for x in p.unused] == [4]


def test_plan_commit_a_claimed_pre_lease_is_a_loser_not_unused():
    # partition 0's pre-lease was claimed by try 10, but the copy won: 10 may have written on its id
    p = plan([won(2, 0, 11), won(3, 1, 12), PartitionResult(2, None)])
    assert 1 in {x.id for x in p.losers} and 1 not in {x.id for x in p.unused}


def test_plan_commit_all_empty():
    p = plan([PartitionResult(0, None), PartitionResult(1, None), PartitionResult(2, None)])
    assert p.winners == ()
    assert sorted(x.id for x in p.losers) == [1, 2, 3, 5] and [x.id for x in p.unused] == [4]
    p = rules.plan_commit([], [], 8, now=NOW, margin_ms=MARGIN_MS)
    assert p.winners == () and p.losers == () and p.unused == ()


def test_plan_commit_refuses_a_record_from_a_try_that_does_not_hold_the_lease():
    """Issue 50 §2: the record names the try that wrote it; only the try that holds the lease (the
    one that claimed the pre-lease, or got the id) may win with it."""
    stranger = PartitionResult(0, 1, record_for(lease(id=1, task_attempt_id=11)))  # try 11 holds lease 2, not 1
    with pytest.raises(e.Conflict) as exc:
        plan([stranger, won(3, 1, 12), PartitionResult(2, None)])
    assert reason_of(exc) == e.LEASE_NOT_CLAIMED
    assert exc.value.detail == {"lease_id": 1, "holder": 10, "reported_by": 11}


def test_plan_commit_refuses_a_record_for_a_pre_lease_no_try_claimed():
    """A try that never claimed the pre-lease (an old client that took it for itself without
    asking) reports a record for it: the lease is not held by that try, so the answer is the claim
    check's, lease_not_claimed (rebuild.md: the record's task_attempt_id must equal the lease's
    holder, and an unclaimed pre-lease has none)."""
    unclaimed = PartitionResult(2, 4, PrecommitRecord(13, 2000, 0, 5, 50))
    with pytest.raises(e.Conflict) as exc:
        plan([won(1, 0, 10), won(3, 1, 12), unclaimed])
    assert reason_of(exc) == e.LEASE_NOT_CLAIMED


@pytest.mark.parametrize(
    "results,error,reason",
    [
        ([PartitionResult(0, 1), PartitionResult(2, 3)], e.Invalid, "partitions_incomplete"),
        ([PartitionResult(0, 1), PartitionResult(0, 2)], e.Invalid, "partitions_incomplete"),
        ([PartitionResult(1, 3)], e.Invalid, "partitions_incomplete"),
        ([PartitionResult(0, 99, PrecommitRecord(1, 1, 0, 1, 1))], e.Conflict, e.STALE_LEASE),  # not of this attempt
        # lease 3 is partition 1's
        ([PartitionResult(0, 3, PrecommitRecord(12, 1, 0, 1, 1)), PartitionResult(1, None)], e.Conflict,
         e.LEASE_MISMATCH),
        # a winner named without its record
        ([PartitionResult(0, 1), PartitionResult(1, None), PartitionResult(2, None)], e.Conflict,
         e.WINNER_NOT_PRECOMMITTED),
        # a winner already ABORTING (its attempt's other leases are fine)
        ([PartitionResult(0, None), PartitionResult(1, None), PartitionResult(2, 6, PrecommitRecord(14, 1, 0, 1, 1))],
         e.Conflict, e.WINNER_NOT_PRECOMMITTED),
    ],
)
def test_plan_commit_refusals(results, error, reason):
    with pytest.raises(error) as exc:
        plan(results)
    assert type(exc.value) is error
    assert exc.value.reason == reason


def test_plan_commit_applies_the_timeout_gate():
    results = [won(1, 0, 10), won(3, 1, 12), PartitionResult(2, None)]
    edge = T0 + ms(TIMEOUT_MS - MARGIN_MS)  # exactly the margin left: decided
    assert len(plan(results, now=edge).winners) == 2
    with pytest.raises(e.Conflict) as exc:
        plan(results, now=edge + ms(1))
    assert reason_of(exc) == e.DEADLINE_TOO_CLOSE and exc.value.detail["lease_ids"] == [1, 3]
    # a later-leased winner is not named
    leases = _attempt_leases()
    leases[2] = lease(id=3, partition=1, task_attempt_id=12, ordinal=2, leased_at=T0 + ms(30_000))
    with pytest.raises(e.Conflict) as exc:
        plan(results, leases=leases, now=edge + ms(1))
    assert exc.value.detail["lease_ids"] == [1]


def test_plan_commit_a_winner_the_recovery_loop_aborted_at_its_deadline_is_refused_as_the_gate_would():
    """The recovery loop aborts a lease that can no longer pass the gate; a commit naming it then
    gets the gate's answer (the attempt is replayed), not winner_not_precommitted."""
    leases = _attempt_leases()
    leases[0] = lease(id=1, partition=0, task_attempt_id=10, ordinal=0, state=LeaseState.ABORTING)
    late = T0 + ms(TIMEOUT_MS)
    with pytest.raises(e.Conflict) as exc:
        plan([won(1, 0, 10), PartitionResult(1, None), PartitionResult(2, None)], leases=leases, now=late)
    assert reason_of(exc) == e.DEADLINE_TOO_CLOSE
    # an ABORTING winner with time left is simply not a winner
    with pytest.raises(e.Conflict) as exc:
        plan([won(1, 0, 10), PartitionResult(1, None), PartitionResult(2, None)], leases=leases)
    assert reason_of(exc) == e.WINNER_NOT_PRECOMMITTED


def test_check_commit_deadlines_margin_edges():
    w = decided(id=7)
    deadline = w.deadline_at
    rules.check_commit_deadlines([w], deadline - ms(MARGIN_MS), MARGIN_MS)  # exactly the margin: allowed
    rules.check_commit_deadlines([w], deadline - ms(MARGIN_MS + 1), MARGIN_MS)
    rules.check_commit_deadlines([], deadline + ms(1), MARGIN_MS)  # no winner, nothing to gate
    for now in (deadline - ms(MARGIN_MS - 1), deadline - ms(MARGIN_MS - 0.5), deadline, deadline + ms(10)):
        with pytest.raises(e.Conflict) as exc:
            rules.check_commit_deadlines([w], now, MARGIN_MS)
        assert exc.value.reason == e.DEADLINE_TOO_CLOSE
        assert exc.value.detail["lease_ids"] == [7]
        assert exc.value.detail["margin_ms"] == MARGIN_MS


def test_check_commit_deadlines_names_only_the_close_winners():
    early = decided(id=1, leased_at=T0)
    late = decided(id=2, leased_at=T0 + ms(30_000))
    now = T0 + ms(TIMEOUT_MS - MARGIN_MS + 1)
    with pytest.raises(e.Conflict) as exc:
        rules.check_commit_deadlines([late, early], now, MARGIN_MS)
    assert exc.value.detail["lease_ids"] == [1]
    rules.check_commit_deadlines([late], now, MARGIN_MS)


def test_deadline_gate_with_zero_margin_never_passes_an_expired_transaction():
    # sub-millisecond precision must not round an expired transaction back into the window
    w = decided()
    with pytest.raises(e.Conflict):
        rules.check_commit_deadlines([w], w.deadline_at + ms(0.5), 0)
    rules.check_commit_deadlines([w], w.deadline_at, 0)


def test_check_same_winners():
    winners = [decided(id=1, partition=0, state=LeaseState.COMMITTED), decided(id=3, partition=1)]
    same = [PartitionResult(0, 1, record_for(winners[0])), PartitionResult(1, 3, record_for(winners[1])),
            PartitionResult(2, None)]
    rules.check_same_winners(same, winners)
    rules.check_same_winners(list(reversed(same)), winners)  # order does not matter
    rules.check_same_winners([PartitionResult(0, 1), PartitionResult(1, 3)], winners)  # names without records
    for other in (
        [PartitionResult(0, 2), PartitionResult(1, 3)],
        [PartitionResult(0, 1), PartitionResult(1, None)],
        [PartitionResult(0, 1), PartitionResult(1, 3), PartitionResult(2, 9)],
        # the same winners with another record: not the decided transaction
        [PartitionResult(0, 1, record_for(winners[0], producer_epoch=1)), PartitionResult(1, 3)],
        [PartitionResult(0, 1), PartitionResult(1, 3, record_for(winners[1], records=11))],
    ):
        with pytest.raises(e.Conflict) as exc:
            rules.check_same_winners(other, winners)
        assert exc.value.reason == e.WINNER_MISMATCH
        assert exc.value.detail["decided"] == [[0, 1], [1, 3]]


def test_same_record_ignores_the_operators_figures():
    x = decided(id=5)
    assert rules.same_record(x, record_for(x, write_ms=99, first_offsets=[["t", 0, 1]]))
    for field in ("producer_id", "producer_epoch", "records", "bytes"):
        assert not rules.same_record(x, record_for(x, **{field: getattr(x, field) + 1})), field


def test_batch_duration_warning():
    assert rules.batch_duration_warning(T0, T0 + ms(10_000), 30_000, 60_000) is None
    assert rules.batch_duration_warning(T0, T0 + ms(30_000), 30_000, 60_000) is None  # exactly the timeout
    assert "restart budget" in rules.batch_duration_warning(T0, T0 + ms(30_001), 30_000, 60_000)


# --- lost data -------------------------------------------------------------------------------


def test_only_refusals_that_mean_the_transaction_is_gone_are_final():
    for code in rules.TRANSACTION_GONE_CODES:
        assert rules.commit_refusal_is_final(code)
    for code in ("unknown_server_error", "request_timed_out", "network_exception", "kafka_error_4242"):
        assert not rules.commit_refusal_is_final(code)


def test_lost_reason_names_each_refused_partition_and_whether_the_log_confirmed_it():
    refused = [
        rules.RefusedCommit(decided(id=2, partition=3, ordinal=2), "producer_fenced", "m", confirmed=False),
        rules.RefusedCommit(decided(id=1, partition=1, ordinal=1), "invalid_producer_epoch", "m", confirmed=True),
    ]
    reason = rules.lost_reason(7, refused)
    assert reason.startswith("batch 7: Kafka refused the decided commit for good: partition 1 (p-1, producer 1001")
    assert "invalid_producer_epoch, loss confirmed in the partition log; partition 3 (p-2" in reason
    assert reason.endswith("producer_fenced, NOT verified in the partition log")
    assert len(rules.lost_reason(7, refused * 100)) == 2000  # bounded for the column


def test_check_not_halted_and_data_lost():
    rules.check_not_halted(sink())
    halted = sink(halted_at=T0, halted_reason="batch 3: ...")
    with pytest.raises(e.Conflict) as exc:
        rules.check_not_halted(halted)
    assert reason_of(exc) == e.SINK_HALTED_LOST_DATA
    assert exc.value.detail["acknowledge"] == "/v1/sinks/s/lost-data/acknowledge"
    assert "read_committed consumer first" in exc.value.message
    cp: Checkpoint = checkpoint(batch_id=3, state=CheckpointState.LOST, lost_reason="fenced")
    lost = rules.data_lost(cp)
    assert lost.reason == e.DATA_LOST and lost.detail == {"batch_id": 3, "lost_reason": "fenced"}


def test_the_retirement_rule_names_each_blocker():
    assert rules.retirement_blockers(0, 0, 0) == []
    assert len(rules.retirement_blockers(1, 1, 1)) == 3
    assert "1 undecided attempt(s)" in rules.retirement_blockers(1, 0, 0)[0]
    assert "decided commit(s) not finished" in rules.retirement_blockers(0, 2, 0)[0]
    assert "3 transactional id(s)" in rules.retirement_blockers(0, 0, 3)[0]


def test_error_bodies():
    err = e.Conflict(e.STALE_GENERATION, "msg", current_generation=2)
    assert err.status == 409
    assert err.to_dict() == {"reason": "stale_generation", "message": "msg", "detail": {"current_generation": 2}}
    assert e.Unavailable("x", "y").to_dict() == {"reason": "x", "message": "y"}
    assert (e.NotFound.status, e.Invalid.status, e.Unavailable.status) == (404, 422, 503)
