"""The invariant checker (coordinator/protocol/invariants.py) over hand-built snapshots: a correct
one passes, and each invariant is shown to catch a deliberately broken one (a checker that cannot
fail proves nothing). I1-I5, I3 over the pool's (sink, ordinal) with taken_at, F1 (no open attempt
of a fenced generation), F2 (a retired sink holds nothing open), and R1 (no quick reuse)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from coordinator.protocol.invariants import (
    Snapshot,
    Violation,
    check_committed_unchanged,
    check_invariants,
    check_no_quick_reuse,
    check_unchanged,
)
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
    quarantine,
    sink,
)

DECIDED = T0 + ms(10_000)
DONE = T0 + ms(11_000)
REACH = timedelta(milliseconds=180_000)  # how long a try that did not win may still act on Kafka


def committed_world() -> Snapshot:
    """A correct snapshot: batch 0 committed by attempt 2 (attempt 1 aborted): partition 0 won by a
    speculative copy over the try that claimed the pre-lease, partition 1 by its first try,
    partition 2 empty (its pre-lease freed unclaimed); the losing try's id in quarantine. Batch 1
    is open: a pre-lease not claimed yet and a claimed one."""
    lease_at = T0 + ms(700)
    return Snapshot(
        sinks=[sink()],
        checkpoints=[
            checkpoint(id=1, batch_id=0, state=CheckpointState.COMMITTED, current_attempt=2, committed_attempt=2,
                       decided_at=DECIDED, committed_at=DONE),
            checkpoint(id=2, batch_id=1, state=CheckpointState.OPEN, current_attempt=1),
        ],
        attempts=[
            attempt(id=1, checkpoint_id=1, number=1, state=AttemptState.ABORTED, abort_reason="superseded",
                    finished_at=T0 + ms(500)),
            attempt(id=2, checkpoint_id=1, number=2, state=AttemptState.COMMITTED, partitions=3,
                    started_at=T0 + ms(500), decided_at=DECIDED, finished_at=DONE),
            attempt(id=3, checkpoint_id=2, number=1, started_at=DONE),
        ],
        leases=[
            # [0] attempt 1's try, aborted and freed
            lease(id=1, attempt_id=1, partition=0, ordinal=5, state=LeaseState.ABORTED, resolved_at=T0 + ms(600)),
            # [1] partition 0's pre-lease, claimed by try 2, lost to the copy [3]
            lease(id=2, attempt_id=2, partition=0, task_attempt_id=2, ordinal=0, taken_at=T0 + ms(500),
                  leased_at=lease_at, state=LeaseState.ABORTED, resolved_at=DONE),
            # [2] partition 1's pre-lease, claimed and won
            decided(id=3, attempt_id=2, partition=1, task_attempt_id=3, ordinal=1, taken_at=T0 + ms(500),
                    leased_at=lease_at, state=LeaseState.COMMITTED, resolved_at=DONE),
            # [3] the speculative copy of partition 0, with its own id: won
            decided(id=4, attempt_id=2, partition=0, task_attempt_id=4, ordinal=2, taken_at=lease_at,
                    leased_at=lease_at, state=LeaseState.COMMITTED, resolved_at=DONE),
            # [4] partition 2's pre-lease: the partition was empty, no try claimed it
            pre_lease(id=5, attempt_id=2, partition=2, ordinal=3, taken_at=T0 + ms(500), leased_at=T0 + ms(500),
                      state=LeaseState.ABORTED, resolved_at=DECIDED),
            # [5] batch 1: a pre-lease on the committed winner's id (free at once), not claimed yet
            pre_lease(id=6, checkpoint_id=2, attempt_id=3, partition=0, ordinal=1, taken_at=DONE, leased_at=DONE),
            # [6] batch 1: a claimed pre-lease on the unclaimed one's id (no producer ever used it)
            lease(id=7, checkpoint_id=2, attempt_id=3, partition=1, task_attempt_id=9, ordinal=3, taken_at=DONE,
                  leased_at=DONE + ms(5)),
        ],
        quarantines=[quarantine(ordinal=0, until=DONE + REACH)],  # the losing try's id
    )


def replace_in(snapshot: Snapshot, kind: str, index: int, **changes) -> Snapshot:
    items = list(getattr(snapshot, kind))
    items[index] = replace(items[index], **changes)
    return replace(snapshot, **{kind: items})


def add_to(snapshot: Snapshot, kind: str, *items) -> Snapshot:
    return replace(snapshot, **{kind: [*getattr(snapshot, kind), *items]})


def only(violations: list[Violation], invariant: str) -> list[Violation]:
    assert violations, "the checker reported nothing"
    assert {v.invariant for v in violations} == {invariant}, [str(v) for v in violations]
    return violations


def test_a_correct_snapshot_has_no_violations():
    s = committed_world()
    assert check_invariants(s) == []
    assert check_invariants(s, settled=True) == []
    assert check_no_quick_reuse(s, REACH) == []
    assert check_invariants(Snapshot()) == []


# --- I1: one decided attempt per checkpoint, and a committed one never changes -----------------


def test_i1_two_decided_attempts():
    s = replace_in(committed_world(), "attempts", 0, state=AttemptState.COMMITTED, abort_reason=None,
                   decided_at=T0 + ms(400))
    v = only(check_invariants(s), "I1")
    assert any("2 decided attempts" in str(x) for x in v)


def test_i1_committed_checkpoint_without_committed_attempt():
    s = replace_in(committed_world(), "checkpoints", 0, committed_attempt=1)
    assert any(x.invariant == "I1" and "is not" in x.message for x in check_invariants(s))


def test_i1_open_checkpoint_with_decided_attempt():
    s = replace_in(committed_world(), "attempts", 2, state=AttemptState.COMMITTING, decided_at=T0 + ms(20_000))
    assert any(x.invariant == "I1" and "OPEN with a decided attempt" in x.message for x in check_invariants(s))


def test_i1_a_pruned_checkpoint_keeps_no_attempts():
    s = replace_in(committed_world(), "checkpoints", 0, history_pruned_at=DONE + ms(1))
    assert any(x.invariant == "I1" and "marked pruned" in x.message for x in check_invariants(s))


def test_i1_history_committed_checkpoint_changed():
    before = committed_world()
    after = replace_in(before, "checkpoints", 0, committed_at=T0 + ms(99_000))
    assert [x.invariant for x in check_committed_unchanged(before, after)] == ["I1"]
    after = replace_in(before, "leases", 2, producer_epoch=5)
    assert [x.invariant for x in check_committed_unchanged(before, after)] == ["I1"]
    assert check_committed_unchanged(before, before) == []
    # an open checkpoint may change
    assert check_committed_unchanged(before, replace_in(before, "checkpoints", 1, current_attempt=2)) == []


def test_i1_history_pruning_is_the_one_allowed_change():
    before = committed_world()
    pruned = replace_in(before, "checkpoints", 0, history_pruned_at=DONE + ms(3_600_000))
    pruned = replace(pruned, attempts=[a for a in pruned.attempts if a.checkpoint_id != 1],
                     leases=[x for x in pruned.leases if x.checkpoint_id != 1])
    assert check_committed_unchanged(before, pruned) == []
    assert check_invariants(pruned) == []
    # pruning that also changed the row is a change
    broken = replace_in(pruned, "checkpoints", 0, committed_attempt=1)
    assert [x.invariant for x in check_committed_unchanged(before, broken)] == ["I1"]


# --- I2: at most one committed transaction per partition, losers aborted -----------------------


def test_i2_two_committed_transactions_for_one_partition():
    s = replace_in(committed_world(), "leases", 1, state=LeaseState.COMMITTED, producer_id=7, producer_epoch=0,
                   records=3, bytes=30)
    v = only(check_invariants(s), "I2")
    assert any("partition 0 has 2 committed transactions" in str(x) for x in v)


def test_i2_loser_not_aborted():
    s = replace_in(committed_world(), "leases", 1, state=LeaseState.LEASED, resolved_at=None)
    assert any(x.invariant == "I2" and "non-winner" in x.message for x in check_invariants(s))


def test_i2_an_unclaimed_pre_lease_left_open_in_a_committed_checkpoint():
    s = replace_in(committed_world(), "leases", 4, state=LeaseState.PRELEASED, resolved_at=None)
    s = replace_in(s, "leases", 6, ordinal=4, transactional_id="p-4")  # (so that its id is not held twice too)
    v = only(check_invariants(s), "I2")
    assert any("non-winner leases [5]" in x.message for x in v)


def test_i2_pending_abort_is_allowed_unless_settled():
    s = replace_in(committed_world(), "leases", 1, state=LeaseState.ABORTING, resolved_at=None)
    assert check_invariants(s) == []
    only(check_invariants(s, settled=True), "I2")


def test_i2_commit_outside_the_decided_attempt():
    s = replace_in(committed_world(), "leases", 0, state=LeaseState.COMMITTED, producer_id=1, producer_epoch=0,
                   records=3, partition=2)
    assert any(x.invariant == "I2" and "outside the decided attempt" in x.message for x in check_invariants(s))


def test_i2_committed_lease_in_open_checkpoint():
    s = replace_in(committed_world(), "leases", 6, state=LeaseState.COMMITTED, records=1,
                   resolved_at=T0 + ms(20_000))
    assert any(x.invariant == "I2" and "open checkpoint" in x.message for x in check_invariants(s))


def test_i2_committed_without_records_and_beyond_partition_count():
    s = replace_in(committed_world(), "leases", 3, records=0)
    assert any("no records" in x.message for x in only(check_invariants(s), "I2"))
    s = replace_in(committed_world(), "attempts", 1, partitions=1)
    assert any("beyond its count" in x.message for x in only(check_invariants(s), "I2"))


def test_i2_committed_checkpoint_with_winner_still_committing():
    s = replace_in(committed_world(), "leases", 3, state=LeaseState.COMMITTING, resolved_at=None)
    assert any(x.invariant == "I2" and "still COMMITTING" in x.message for x in check_invariants(s))


# --- I3: an id of the pool is held by at most one unresolved lease, in turn -------------------


def test_i3_an_id_held_by_two_unresolved_leases():
    # batch 1's claimed lease takes ordinal 0 while batch 0's losing try on it is still ABORTING
    s = replace_in(committed_world(), "leases", 1, state=LeaseState.ABORTING, resolved_at=None)
    s = replace_in(s, "leases", 6, ordinal=0, transactional_id="p-0")
    v = only(check_invariants(s), "I3")
    assert any("held by 2 unresolved leases [2, 7]" in x.message for x in v)
    assert any("p-0 leased to 7 before lease 2 was resolved" in x.message for x in v)


def test_i3_two_unresolved_pre_leases_on_one_id():
    s = add_to(committed_world(), "leases",
               pre_lease(id=8, checkpoint_id=2, attempt_id=3, partition=2, ordinal=1, taken_at=DONE, leased_at=DONE))
    assert any("held by 2 unresolved leases [6, 8]" in x.message for x in only(check_invariants(s), "I3"))


def test_i3_is_per_sink_the_same_ordinal_of_two_sinks_is_two_ids():
    other = sink(id=2, name="other", transactional_id_prefix="o", generation=1)
    s = add_to(committed_world(), "sinks", other)
    s = add_to(s, "checkpoints", checkpoint(id=3, sink_id=2))
    s = add_to(s, "attempts", attempt(id=4, checkpoint_id=3, started_at=DONE))
    s = add_to(s, "leases", lease(id=8, sink_id=2, checkpoint_id=3, attempt_id=4, ordinal=3, transactional_id="o-3",
                                  taken_at=DONE, leased_at=DONE))
    assert check_invariants(s) == []  # sink 1's ordinal 3 is held too: another id
    s = replace_in(s, "leases", 7, sink_id=1)
    assert any("held by 2 unresolved leases" in x.message for x in only(check_invariants(s), "I3"))


def test_i3_re_leased_before_resolution_in_history():
    # attempt 1's try on ordinal 0 was resolved only after batch 0's pre-lease took ordinal 0
    s = replace_in(committed_world(), "leases", 0, ordinal=0, transactional_id="p-0", resolved_at=T0 + ms(800))
    v = only(check_invariants(s), "I3")
    assert any("leased to 2 before lease 1 was resolved" in x.message for x in v)


def test_i3_counts_from_when_the_id_was_taken_not_when_a_try_claimed_it():
    """A pre-lease holds its id from begin (taken_at), before any try claims it (leased_at): an
    id taken while its previous lease was unresolved is held twice, whenever the claim came."""
    # lease 2 took ordinal 0 at 500 ms and was claimed at 700 ms; lease 1 on it resolved at 600 ms
    s = replace_in(committed_world(), "leases", 0, ordinal=0, transactional_id="p-0", resolved_at=T0 + ms(600))
    v = only(check_invariants(s), "I3")
    assert any("leased to 2 before lease 1 was resolved" in x.message for x in v)


def test_i3_same_instant_is_in_turn():
    # a manual clock: resolved and taken again at the same instant is not an overlap
    s = replace_in(committed_world(), "leases", 0, ordinal=0, transactional_id="p-0", resolved_at=T0 + ms(500))
    assert check_invariants(s) == []


def test_i3_resolved_at_follows_the_state():
    s = replace_in(committed_world(), "leases", 6, resolved_at=DONE + ms(10))  # LEASED, yet resolved
    assert any("is LEASED with resolved_at" in x.message for x in only(check_invariants(s), "I3"))
    s = replace_in(committed_world(), "leases", 4, resolved_at=None)  # ABORTED, yet unresolved
    assert any("is ABORTED with resolved_at None" in x.message for x in only(check_invariants(s), "I3"))


# --- I4: no commit decided within the margin of a winner's deadline ---------------------------


def test_i4_decided_within_the_margin():
    lease_at = T0 + ms(700)
    decided_at = lease_at + ms(TIMEOUT_MS - MARGIN_MS + 1)  # 1 ms inside the margin of the winners' deadline
    s = replace_in(committed_world(), "attempts", 1, decided_at=decided_at, finished_at=decided_at)
    v = only(check_invariants(s), "I4")
    assert {x.message for x in v} == {
        "lease 3 was decided within the margin of its deadline",
        "lease 4 was decided within the margin of its deadline",
    }
    edge = lease_at + ms(TIMEOUT_MS - MARGIN_MS)  # exactly at the margin is fine
    assert check_invariants(replace_in(committed_world(), "attempts", 1, decided_at=edge)) == []


def test_i4_winner_without_decision_time():
    s = replace_in(committed_world(), "attempts", 1, decided_at=None)
    assert any(x.invariant == "I4" and "no decision time" in x.message for x in check_invariants(s))


# --- I5: a refused call changes nothing ------------------------------------------------------


def test_i5_check_unchanged():
    s = committed_world()
    assert check_unchanged(s, committed_world()) == []
    changed = replace_in(s, "leases", 6, state=LeaseState.ABORTING)
    v = check_unchanged(s, changed)
    assert [x.invariant for x in v] == ["I5"] and "leases" in v[0].message
    assert "sinks" in check_unchanged(s, replace_in(s, "sinks", 0, generation=2))[0].message
    # the quarantine is durable state too: a refused call must not touch it
    v = check_unchanged(s, replace_in(s, "quarantines", 0, until=DONE))
    assert [x.invariant for x in v] == ["I5"] and "quarantines" in v[0].message


# --- F1, F2: fencing and retirement leave nothing open (issue 50 §3) --------------------------


def test_f1_an_open_attempt_of_a_fenced_generation():
    # a new generation started, but batch 1's attempt of generation 1 is still open
    s = replace_in(committed_world(), "sinks", 0, generation=2)
    v = only(check_invariants(s), "F1")
    assert [x.message for x in v] == ["attempt 3 of fenced generation 1 is open (sink s is at generation 2)"]


def test_f1_holds_once_the_fenced_attempt_is_aborted_or_of_the_current_generation():
    fenced = replace_in(committed_world(), "sinks", 0, generation=2)
    aborted = replace_in(fenced, "attempts", 2, state=AttemptState.ABORTED, abort_reason="fenced_by_generation_2",
                         finished_at=DONE)
    aborted = replace_in(aborted, "leases", 5, state=LeaseState.ABORTED, resolved_at=DONE)
    aborted = replace_in(aborted, "leases", 6, state=LeaseState.ABORTING)
    assert check_invariants(aborted) == []
    assert check_invariants(replace_in(fenced, "attempts", 2, generation=2)) == []


def test_f2_a_retired_sink_with_an_open_attempt_and_held_ids():
    s = replace_in(committed_world(), "sinks", 0, retired_at=DONE + ms(1))
    v = only(check_invariants(s), "F2")
    assert "retired sink s has an open attempt 3" in {x.message for x in v}
    assert {x.message for x in v if "still holds" in x.message} == {
        "retired sink s still holds p-1 (lease 6, PRELEASED)",
        "retired sink s still holds p-3 (lease 7, LEASED)",
    }


def test_f2_a_retired_sink_with_only_an_abort_pending():
    s = replace_in(committed_world(), "sinks", 0, retired_at=DONE + ms(1))
    s = replace_in(s, "attempts", 2, state=AttemptState.ABORTED, abort_reason="stop", finished_at=DONE)
    s = replace_in(s, "leases", 5, state=LeaseState.ABORTED, resolved_at=DONE)
    s = replace_in(s, "leases", 6, state=LeaseState.ABORTING)
    assert [x.message for x in only(check_invariants(s), "F2")] == [
        "retired sink s still holds p-3 (lease 7, ABORTING)"]
    # once the abort is done, a retired sink holds nothing
    assert check_invariants(replace_in(s, "leases", 6, state=LeaseState.ABORTED, resolved_at=DONE + ms(2))) == []


# --- R1: no quick reuse ------------------------------------------------------------------------


def _reused(ordinal: int, taken_at) -> Snapshot:
    """Batch 1's claimed lease takes `ordinal` at `taken_at` instead of ordinal 3."""
    return replace_in(committed_world(), "leases", 6, ordinal=ordinal, transactional_id=f"p-{ordinal}",
                      taken_at=taken_at, leased_at=taken_at)


def test_r1_an_id_a_losing_try_held_is_not_taken_again_before_its_reach():
    # ordinal 0: partition 0's claimed pre-lease lost (its try may still be alive), leased at 700 ms
    quick = _reused(0, DONE + ms(1))
    assert check_invariants(quick) == []  # in turn: I3 holds
    v = only(check_no_quick_reuse(quick, REACH), "R1")
    assert "p-0 taken again (lease 7)" in v[0].message and "lease 2 (ABORTED)" in v[0].message
    assert check_no_quick_reuse(_reused(0, T0 + ms(700) + REACH), REACH) == []


def test_r1_exempts_a_committed_winner_and_a_pre_lease_no_try_claimed():
    # ordinal 1: batch 0's committed winner; ordinal 3: a pre-lease nobody claimed (no producer)
    assert check_no_quick_reuse(_reused(1, DONE + ms(1)), REACH) == []
    assert check_no_quick_reuse(committed_world(), REACH) == []  # lease 7 took ordinal 3 at once
    # had a try claimed ordinal 3's pre-lease and lost, the same reuse would be quick
    claimed = replace_in(committed_world(), "leases", 4, task_attempt_id=8, leased_at=T0 + ms(900))
    assert [x.invariant for x in check_no_quick_reuse(claimed, REACH)] == ["R1"]
