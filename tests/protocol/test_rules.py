"""Unit tests of the pure protocol core (coordinator/protocol): state machines, rules and the
invariant checker. No database, no clock, no network."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from coordinator.protocol import errors as e
from coordinator.protocol import rules
from coordinator.protocol.invariants import (
    Snapshot,
    check_committed_unchanged,
    check_invariants,
    check_unchanged,
)
from coordinator.protocol.model import (
    FIRST_TRY_TASK_ATTEMPT,
    Attempt,
    Checkpoint,
    Lease,
    PartitionResult,
    PrecommitRecord,
    Sink,
    TransactionalId,
)
from coordinator.protocol.rules import BeginAction, PrecommitRequest
from coordinator.protocol.states import (
    ATTEMPT_TRANSITIONS,
    CHECKPOINT_TRANSITIONS,
    LEASE_TRANSITIONS,
    TRANSACTIONAL_ID_TRANSITIONS,
    AttemptState,
    CheckpointState,
    LeaseState,
    TransactionalIdState,
    is_terminal,
    require_transition,
)
from coordinator.protocol.errors import IllegalTransition

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TIMEOUT_MS = 60_000
MARGIN_MS = 6_000


def ms(n: float) -> timedelta:
    return timedelta(milliseconds=n)


# --- record builders -------------------------------------------------------------------------


def sink(**kw) -> Sink:
    base = dict(
        id=1, name="s", transactional_id_prefix="p", bootstrap_servers="k:9092", topics=["t"],
        transaction_timeout_ms=TIMEOUT_MS, commit_margin_ms=MARGIN_MS, max_pool_size=16, generation=1,
        lineage_query_id="q", writer_token_version=1, created_at=T0,
    )
    base.update(kw)
    return Sink(**base)


def checkpoint(**kw) -> Checkpoint:
    base = dict(
        id=1, sink_id=1, query_id="q", batch_id=0, state=CheckpointState.OPEN, current_attempt=1,
        committed_attempt=None, created_at=T0, decided_at=None, committed_at=None,
    )
    base.update(kw)
    return Checkpoint(**base)


def attempt(**kw) -> Attempt:
    base = dict(
        id=1, checkpoint_id=1, number=1, generation=1, state=AttemptState.OPEN, partitions=None,
        started_at=T0, decided_at=None, finished_at=None, abort_reason=None,
    )
    base.update(kw)
    return Attempt(**base)


def lease(**kw) -> Lease:
    base = dict(
        id=1, sink_id=1, checkpoint_id=1, attempt_id=1, partition=0, task_attempt_id=1,
        transactional_id="p-0", state=LeaseState.LEASED, leased_at=T0, deadline_at=T0 + ms(TIMEOUT_MS),
        producer_id=None, producer_epoch=None, records=None, bytes=None, precommitted_at=None, resolved_at=None,
    )
    base.update(kw)
    return Lease(**base)


def precommitted(**kw) -> Lease:
    base = dict(state=LeaseState.PRECOMMITTED, producer_id=100, producer_epoch=0, records=10, bytes=1000,
                precommitted_at=T0 + ms(1000))
    base.update(kw)
    return lease(**base)


def tid(**kw) -> TransactionalId:
    base = dict(id=1, sink_id=1, ordinal=0, transactional_id="p-0", state=TransactionalIdState.FREE, lease_id=None)
    base.update(kw)
    return TransactionalId(**base)


def reason_of(excinfo: pytest.ExceptionInfo) -> str:
    return excinfo.value.reason


# --- state machines --------------------------------------------------------------------------

LEGAL = {
    CheckpointState: {
        (CheckpointState.OPEN, CheckpointState.COMMITTING),
        (CheckpointState.COMMITTING, CheckpointState.COMMITTED),
        (CheckpointState.COMMITTING, CheckpointState.LOST),
    },
    AttemptState: {
        (AttemptState.OPEN, AttemptState.COMMITTING),
        (AttemptState.OPEN, AttemptState.ABORTED),
        (AttemptState.COMMITTING, AttemptState.COMMITTED),
        (AttemptState.COMMITTING, AttemptState.LOST),
    },
    LeaseState: {
        (LeaseState.LEASED, LeaseState.PRECOMMITTED),
        (LeaseState.LEASED, LeaseState.ABORTING),
        (LeaseState.LEASED, LeaseState.COMMITTING),  # the pre-commit record came with the commit
        (LeaseState.LEASED, LeaseState.ABORTED),  # an empty partition's unused first-try lease
        (LeaseState.PRECOMMITTED, LeaseState.COMMITTING),
        (LeaseState.PRECOMMITTED, LeaseState.ABORTING),
        (LeaseState.COMMITTING, LeaseState.COMMITTED),
        (LeaseState.ABORTING, LeaseState.ABORTED),
        (LeaseState.COMMITTING, LeaseState.LOST_ABORTING),
        (LeaseState.LOST_ABORTING, LeaseState.LOST),
    },
    TransactionalIdState: {
        (TransactionalIdState.FREE, TransactionalIdState.LEASED),
        (TransactionalIdState.LEASED, TransactionalIdState.FREE),
    },
}


@pytest.mark.parametrize("enum", list(LEGAL), ids=lambda x: x.__name__)
def test_require_transition_accepts_exactly_the_legal_moves(enum):
    legal = LEGAL[enum]
    for old, new in itertools.product(list(enum), list(enum)):
        if (old, new) in legal:
            require_transition(old, new)
        else:
            with pytest.raises(IllegalTransition):
                require_transition(old, new)


def test_tables_match_the_expected_moves():
    for enum, table in [
        (CheckpointState, CHECKPOINT_TRANSITIONS),
        (AttemptState, ATTEMPT_TRANSITIONS),
        (LeaseState, LEASE_TRANSITIONS),
        (TransactionalIdState, TRANSACTIONAL_ID_TRANSITIONS),
    ]:
        assert set(table) == set(enum)
        assert {(o, n) for o, targets in table.items() for n in targets} == LEGAL[enum]


def test_require_transition_rejects_a_move_across_machines():
    # same string value, different machine
    with pytest.raises(IllegalTransition):
        require_transition(AttemptState.OPEN, CheckpointState.COMMITTING)
    with pytest.raises(IllegalTransition):
        require_transition(LeaseState.PRECOMMITTED, AttemptState.COMMITTING)


def test_no_way_back_from_committed_or_aborted():
    for old in (CheckpointState.COMMITTED, AttemptState.COMMITTED, LeaseState.COMMITTED):
        for new in type(old):
            with pytest.raises(IllegalTransition):
                require_transition(old, new)
    # an abort can never turn into a commit (I2)
    for new in (AttemptState.COMMITTING, AttemptState.COMMITTED, AttemptState.OPEN):
        with pytest.raises(IllegalTransition):
            require_transition(AttemptState.ABORTED, new)
    for old in (LeaseState.ABORTING, LeaseState.ABORTED):
        for new in (LeaseState.COMMITTING, LeaseState.COMMITTED, LeaseState.PRECOMMITTED, LeaseState.LEASED):
            with pytest.raises(IllegalTransition):
                require_transition(old, new)
    # a decided winner cannot be aborted any more
    with pytest.raises(IllegalTransition):
        require_transition(LeaseState.COMMITTING, LeaseState.ABORTING)


def test_terminal_states():
    terminal = {
        s for enum in LEGAL for s in enum if is_terminal(s)
    }
    assert terminal == {
        CheckpointState.COMMITTED,
        CheckpointState.LOST,
        AttemptState.COMMITTED,
        AttemptState.ABORTED,
        AttemptState.LOST,
        LeaseState.COMMITTED,
        LeaseState.ABORTED,
        LeaseState.LOST,
    }


# --- sinks, prefixes, timeouts ---------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["a", "orders-eos", "A.b_c-1", "x" * rules.MAX_PREFIX_LENGTH])
def test_validate_prefix_accepts(prefix):
    rules.validate_prefix(prefix)


@pytest.mark.parametrize("prefix", ["", "has space", "slash/", "ünï", "x" * (rules.MAX_PREFIX_LENGTH + 1), "a\n"])
def test_validate_prefix_rejects(prefix):
    with pytest.raises(e.Invalid) as exc:
        rules.validate_prefix(prefix)
    assert exc.value.reason == "invalid_transactional_id_prefix"


@pytest.mark.parametrize("name", ["", "-leading", ".x", "a b", "x" * (rules.MAX_NAME_LENGTH + 1), "orders\n"])
def test_validate_sink_name_rejects(name):
    with pytest.raises(e.Invalid) as exc:
        rules.validate_sink_name(name)
    assert exc.value.reason == "invalid_sink_name"


def test_validate_sink_name_accepts():
    rules.validate_sink_name("orders.eos_1-a")


@pytest.mark.parametrize(
    "a,b,clash",
    [
        ("orders", "orders", True),
        ("orders", "orders-eu", True),
        ("orders-eu", "orders", True),
        ("orders", "order", True),
        ("orders-a", "orders-b", False),
        ("a", "b", False),
        ("xorders", "orders", False),
    ],
)
def test_prefixes_clash(a, b, clash):
    assert rules.prefixes_clash(a, b) is clash


def test_transactional_id_for():
    assert rules.transactional_id_for("orders", 7) == "orders-7"
    # a prefix ending in a separator is not given a second one ("demo-0", not "demo--0")
    assert rules.transactional_id_for("demo-", 0) == "demo-0"
    assert rules.transactional_id_for("app.", 3) == "app.3"
    assert rules.transactional_id_stem("demo-") == rules.transactional_id_stem("demo") == "demo-"


def test_validate_timeouts():
    rules.validate_timeouts(60_000, 6_000, 900_000)
    rules.validate_timeouts(900_000, 1, 900_000)  # exactly the broker maximum is fine
    with pytest.raises(e.Invalid) as exc:
        rules.validate_timeouts(900_001, 6_000, 900_000)
    assert exc.value.reason == "transaction_timeout_above_broker_max"
    with pytest.raises(e.Invalid) as exc:
        rules.validate_timeouts(60_000, 60_000, 900_000)
    assert exc.value.reason == "commit_margin_too_large"
    with pytest.raises(e.Invalid) as exc:
        rules.validate_timeouts(60_000, 70_000, 900_000)
    assert exc.value.reason == "commit_margin_too_large"


def test_validate_timeouts_rejects_a_negative_margin():
    # a negative margin would let the gate decide commits of transactions past their deadline (I4)
    with pytest.raises(e.Invalid) as exc:
        rules.validate_timeouts(60_000, -1, 900_000)
    assert exc.value.reason == "commit_margin_negative"
    rules.validate_timeouts(60_000, 0, 900_000)  # zero is allowed: the gate still refuses expired ones


@pytest.mark.parametrize(
    "timeout,margin",
    [
        (60_000, 6_000),  # a tenth
        (900_000, 90_000),
        (30_000, 5_000),  # at least 5 s
        (50_000, 5_000),
        (8_000, 4_000),  # but never more than half the timeout
        (1_000, 500),
    ],
)
def test_default_commit_margin_ms(timeout, margin):
    assert rules.default_commit_margin_ms(timeout) == margin
    rules.validate_timeouts(timeout, margin, 900_000)  # the default always passes validation


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
    assert rules.decide_begin(CheckpointState.COMMITTING, attempt(state=AttemptState.COMMITTING), 2) is BeginAction.RESUME
    assert rules.decide_begin(CheckpointState.OPEN, None, 1) is BeginAction.NEW_ATTEMPT
    assert rules.decide_begin(CheckpointState.OPEN, open_g1, 1) is BeginAction.CONTINUE
    # an open attempt of an older generation is not continued
    assert rules.decide_begin(CheckpointState.OPEN, open_g1, 2) is BeginAction.NEW_ATTEMPT
    # an aborted attempt of the same generation is not continued either
    aborted = attempt(generation=1, state=AttemptState.ABORTED, abort_reason="x")
    assert rules.decide_begin(CheckpointState.OPEN, aborted, 1) is BeginAction.NEW_ATTEMPT


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
        with pytest.raises(e.Invalid):
            rules.check_partition(p, 4)


# --- pre-commit ------------------------------------------------------------------------------


def test_transaction_deadline():
    assert rules.transaction_deadline(T0, 60_000) == T0 + ms(60_000)


def test_precommit_already_recorded():
    req = PrecommitRequest(producer_id=100, producer_epoch=0, records=10, bytes=1000)
    assert rules.precommit_already_recorded(lease(), req) is False  # LEASED: not yet
    for state in (LeaseState.PRECOMMITTED, LeaseState.COMMITTING, LeaseState.COMMITTED):
        assert rules.precommit_already_recorded(precommitted(state=state), req) is True
    # aborted leases are not a recorded pre-commit: the caller's own checks decide
    assert rules.precommit_already_recorded(precommitted(state=LeaseState.ABORTING), req) is False
    for different in (
        PrecommitRequest(101, 0, 10, 1000),
        PrecommitRequest(100, 1, 10, 1000),
        PrecommitRequest(100, 0, 11, 1000),
        PrecommitRequest(100, 0, 10, 1001),
    ):
        with pytest.raises(e.Conflict) as exc:
            rules.precommit_already_recorded(precommitted(), different)
        assert exc.value.reason == e.PRECOMMIT_MISMATCH


def test_check_precommit():
    now = T0 + ms(1000)
    rules.check_precommit(lease(), now, MARGIN_MS)
    for state in (LeaseState.PRECOMMITTED, LeaseState.ABORTING, LeaseState.ABORTED, LeaseState.COMMITTED):
        with pytest.raises(e.Conflict) as exc:
            rules.check_precommit(lease(state=state), now, MARGIN_MS)
        assert exc.value.reason == e.STALE_LEASE
    edge = T0 + ms(TIMEOUT_MS - MARGIN_MS)  # exactly the margin left: allowed
    rules.check_precommit(lease(), edge, MARGIN_MS)
    with pytest.raises(e.Conflict) as exc:
        rules.check_precommit(lease(), edge + ms(1), MARGIN_MS)
    assert exc.value.reason == e.DEADLINE_TOO_CLOSE


# --- commit ----------------------------------------------------------------------------------


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
    return [
        precommitted(id=1, partition=0, task_attempt_id=1, transactional_id="p-0"),
        precommitted(id=2, partition=0, task_attempt_id=2, transactional_id="p-1"),  # speculative copy
        precommitted(id=3, partition=1, task_attempt_id=3, transactional_id="p-2"),
        lease(id=4, partition=2, task_attempt_id=4, transactional_id="p-3"),  # failed task, never flushed
        lease(id=5, partition=2, task_attempt_id=5, transactional_id="p-4", state=LeaseState.ABORTING),
    ]


def test_plan_commit_chooses_winners_and_losers():
    plan = rules.plan_commit(
        _attempt_leases(),
        [PartitionResult(0, 2), PartitionResult(1, 3), PartitionResult(2, None)],
        max_partitions=8,
    )
    assert [w.id for w in plan.winners] == [2, 3]
    # every undecided non-winner loses; one already ABORTING is not planned twice
    assert sorted(x.id for x in plan.losers) == [1, 4]


def test_plan_commit_takes_records_that_come_with_the_commit_and_frees_unused_first_try_leases():
    first = [lease(id=i + 1, partition=i, task_attempt_id=FIRST_TRY_TASK_ATTEMPT)
             for i in range(3)]
    speculative = lease(id=9, partition=0, task_attempt_id=42)
    old_style = precommitted(id=10, partition=2, task_attempt_id=43)
    rec = PrecommitRecord(7, 0, 5, 50)
    plan = rules.plan_commit(
        [*first, speculative, old_style],
        [PartitionResult(0, 9, rec), PartitionResult(1, None), PartitionResult(2, 10, PrecommitRecord(100, 0, 10, 1000))],
        64,
    )
    assert [w.id for w in plan.winners] == [9, 10]
    assert [(x.id, r) for x, r in plan.records] == [(9, rec)]  # a pre-committed winner's record is already stored
    assert [x.id for x in plan.unused] == [2]  # partition 1 was empty: its first try never made a producer
    assert sorted(x.id for x in plan.losers) == [1, 3]  # first tries that lost may have written: abort on Kafka
    # a pre-committed winner named with another record is refused
    with pytest.raises(e.Conflict) as mismatch:
        rules.plan_commit([old_style], [PartitionResult(0, None), PartitionResult(1, None),
                                        PartitionResult(2, 10, PrecommitRecord(100, 1, 10, 1000))], 64)
    assert reason_of(mismatch) == e.PRECOMMIT_MISMATCH
    # a LEASED winner without a record is refused
    with pytest.raises(e.Conflict) as bare:
        rules.plan_commit(first, [PartitionResult(0, 1)], 64)
    assert reason_of(bare) == e.WINNER_NOT_PRECOMMITTED


def test_check_offsets():
    rules.check_offsets(None, "sha256:a", 3)  # nothing bound yet
    rules.check_offsets("sha256:a", None, 3)  # an older client names none
    rules.check_offsets("sha256:a", "sha256:a", 3)
    with pytest.raises(e.Conflict) as refused:
        rules.check_offsets("sha256:a", "sha256:b", 3)
    assert reason_of(refused) == e.OFFSETS_MISMATCH and refused.value.detail["batch_id"] == 3


def test_validate_quarantine():
    rules.validate_quarantine(180_000, 30_000, 60_000, 60_000)
    with pytest.raises(e.Invalid) as refused:
        rules.validate_quarantine(150_000, 30_000, 60_000, 60_000)  # equal to what a try can reach: too short
    assert reason_of(refused) == "transactional_id_quarantine_too_short"


def test_only_the_first_try_uses_the_pre_lease():
    assert rules.is_first_try(0, 0)
    assert not rules.is_first_try(0, 1)  # a retry or a speculative copy
    assert not rules.is_first_try(1, 0)  # a stage retry: its task attempts restart at 0


def test_plan_commit_all_empty():
    plan = rules.plan_commit(_attempt_leases(), [PartitionResult(0, None), PartitionResult(1, None)], 8)
    assert plan.winners == ()
    assert sorted(x.id for x in plan.losers) == [1, 2, 3, 4]
    plan = rules.plan_commit([], [], 8)
    assert plan.winners == () and plan.losers == ()


@pytest.mark.parametrize(
    "results,error,reason",
    [
        ([PartitionResult(0, 1), PartitionResult(2, 3)], e.Invalid, "partitions_incomplete"),
        ([PartitionResult(0, 1), PartitionResult(0, 2)], e.Invalid, "partitions_incomplete"),
        ([PartitionResult(1, 3)], e.Invalid, "partitions_incomplete"),
        ([PartitionResult(0, 99)], e.Conflict, e.STALE_LEASE),  # not a lease of this attempt
        ([PartitionResult(0, 3), PartitionResult(1, None)], e.Conflict, e.LEASE_MISMATCH),  # lease 3 is partition 1's
        (
            [PartitionResult(0, 1), PartitionResult(1, 3), PartitionResult(2, 4)],
            e.Conflict,
            e.WINNER_NOT_PRECOMMITTED,
        ),
        (
            [PartitionResult(0, 1), PartitionResult(1, 3), PartitionResult(2, 5)],
            e.Conflict,
            e.WINNER_NOT_PRECOMMITTED,
        ),
    ],
)
def test_plan_commit_refusals(results, error, reason):
    with pytest.raises(error) as exc:
        rules.plan_commit(_attempt_leases(), results, 8)
    assert type(exc.value) is error
    assert exc.value.reason == reason


def test_check_commit_deadlines_margin_edges():
    w = precommitted(id=7)
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
    early = precommitted(id=1, leased_at=T0, deadline_at=T0 + ms(TIMEOUT_MS))
    late = precommitted(id=2, leased_at=T0 + ms(30_000), deadline_at=T0 + ms(30_000 + TIMEOUT_MS))
    now = T0 + ms(TIMEOUT_MS - MARGIN_MS + 1)
    with pytest.raises(e.Conflict) as exc:
        rules.check_commit_deadlines([late, early], now, MARGIN_MS)
    assert exc.value.detail["lease_ids"] == [1]
    rules.check_commit_deadlines([late], now, MARGIN_MS)


def test_deadline_gate_with_zero_margin_never_passes_an_expired_transaction():
    # sub-millisecond precision must not round an expired transaction back into the window
    w = precommitted()
    with pytest.raises(e.Conflict):
        rules.check_commit_deadlines([w], w.deadline_at + timedelta(microseconds=500), 0)
    rules.check_commit_deadlines([w], w.deadline_at, 0)


def test_check_same_winners():
    decided = [precommitted(id=1, partition=0, state=LeaseState.COMMITTED), precommitted(id=3, partition=1)]
    rules.check_same_winners([PartitionResult(0, 1), PartitionResult(1, 3), PartitionResult(2, None)], decided)
    rules.check_same_winners([PartitionResult(1, 3), PartitionResult(0, 1)], decided)  # order does not matter
    for other in (
        [PartitionResult(0, 2), PartitionResult(1, 3)],
        [PartitionResult(0, 1), PartitionResult(1, None)],
        [PartitionResult(0, 1), PartitionResult(1, 3), PartitionResult(2, 9)],
    ):
        with pytest.raises(e.Conflict) as exc:
            rules.check_same_winners(other, decided)
        assert exc.value.reason == e.WINNER_MISMATCH
        assert exc.value.detail["decided"] == [[0, 1], [1, 3]]


def test_batch_duration_warning():
    assert rules.batch_duration_warning(T0, T0 + ms(10_000), 30_000, 60_000) is None
    assert rules.batch_duration_warning(T0, T0 + ms(30_000), 30_000, 60_000) is None  # exactly the timeout
    assert "restart budget" in rules.batch_duration_warning(T0, T0 + ms(30_001), 30_000, 60_000)


def test_age_fraction():
    x = lease()
    assert rules.transaction_age_fraction(x, T0 + ms(48_000), TIMEOUT_MS) == pytest.approx(0.8)


def test_error_bodies():
    err = e.Conflict(e.STALE_GENERATION, "msg", current_generation=2)
    assert err.status == 409
    assert err.to_dict() == {"reason": "stale_generation", "message": "msg", "detail": {"current_generation": 2}}
    assert e.Unavailable("x", "y").to_dict() == {"reason": "x", "message": "y"}
    assert (e.NotFound.status, e.Invalid.status, e.Unavailable.status) == (404, 422, 503)


# --- invariants: the checker must be able to fail --------------------------------------------


def committed_world() -> Snapshot:
    """A correct snapshot: batch 0 committed by attempt 2 (attempt 1 aborted), one winner per
    non-empty partition, the losers aborted, every id FREE; plus an open attempt of batch 1."""
    decided = T0 + ms(10_000)
    done = T0 + ms(11_000)
    return Snapshot(
        sinks=[sink()],
        checkpoints=[
            checkpoint(id=1, batch_id=0, state=CheckpointState.COMMITTED, current_attempt=2, committed_attempt=2,
                       decided_at=decided, committed_at=done),
            checkpoint(id=2, batch_id=1, state=CheckpointState.OPEN, current_attempt=1),
        ],
        attempts=[
            attempt(id=1, checkpoint_id=1, number=1, state=AttemptState.ABORTED, abort_reason="superseded",
                    finished_at=T0 + ms(500)),
            attempt(id=2, checkpoint_id=1, number=2, state=AttemptState.COMMITTED, partitions=3,
                    started_at=T0 + ms(500), decided_at=decided, finished_at=done),
            attempt(id=3, checkpoint_id=2, number=1, started_at=done),
        ],
        leases=[
            lease(id=1, attempt_id=1, partition=0, transactional_id="p-0", state=LeaseState.ABORTED,
                  resolved_at=T0 + ms(600)),
            precommitted(id=2, attempt_id=2, partition=0, task_attempt_id=2, transactional_id="p-0",
                         leased_at=T0 + ms(700), deadline_at=T0 + ms(700 + TIMEOUT_MS),
                         state=LeaseState.COMMITTED, resolved_at=done),
            precommitted(id=3, attempt_id=2, partition=0, task_attempt_id=3, transactional_id="p-1",
                         leased_at=T0 + ms(700), deadline_at=T0 + ms(700 + TIMEOUT_MS),
                         state=LeaseState.ABORTED, resolved_at=done),
            precommitted(id=4, attempt_id=2, partition=1, task_attempt_id=4, transactional_id="p-2",
                         leased_at=T0 + ms(700), deadline_at=T0 + ms(700 + TIMEOUT_MS),
                         state=LeaseState.COMMITTED, resolved_at=done),
            # partition 2 was empty: no lease
            lease(id=5, checkpoint_id=2, attempt_id=3, partition=0, transactional_id="p-0",
                  leased_at=done + ms(1), deadline_at=done + ms(1 + TIMEOUT_MS)),
        ],
        transactional_ids=[
            tid(id=1, ordinal=0, transactional_id="p-0", state=TransactionalIdState.LEASED, lease_id=5),
            tid(id=2, ordinal=1, transactional_id="p-1"),
            tid(id=3, ordinal=2, transactional_id="p-2"),
        ],
    )


def replace_in(snapshot: Snapshot, kind: str, index: int, **changes) -> Snapshot:
    items = list(getattr(snapshot, kind))
    items[index] = type(items[index])(**{**items[index].__dict__, **changes})
    return Snapshot(**{**snapshot.__dict__, kind: items})


def only(violations, invariant):
    assert violations, "the checker reported nothing"
    assert {v.invariant for v in violations} == {invariant}, [str(v) for v in violations]
    return violations


def test_a_correct_snapshot_has_no_violations():
    s = committed_world()
    assert check_invariants(s) == []
    assert check_invariants(s, settled=True) == []
    assert check_invariants(Snapshot()) == []


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
    v = check_invariants(s)
    assert any(x.invariant == "I1" and "OPEN with a decided attempt" in x.message for x in v)


def test_i1_history_committed_checkpoint_changed():
    before = committed_world()
    after = replace_in(before, "checkpoints", 0, committed_at=T0 + ms(99_000))
    assert [x.invariant for x in check_committed_unchanged(before, after)] == ["I1"]
    after = replace_in(before, "leases", 1, producer_epoch=5)
    assert [x.invariant for x in check_committed_unchanged(before, after)] == ["I1"]
    assert check_committed_unchanged(before, before) == []
    # an open checkpoint may change
    assert check_committed_unchanged(before, replace_in(before, "checkpoints", 1, current_attempt=2)) == []


def test_i2_two_committed_transactions_for_one_partition():
    s = replace_in(committed_world(), "leases", 2, state=LeaseState.COMMITTED)
    v = only(check_invariants(s), "I2")
    assert any("partition 0 has 2 committed transactions" in str(x) for x in v)


def test_i2_loser_not_aborted():
    s = replace_in(committed_world(), "leases", 2, state=LeaseState.PRECOMMITTED, resolved_at=None)
    # (its id p-1 is FREE while the lease is unresolved, which I3 reports too)
    v = check_invariants(s)
    assert any(x.invariant == "I2" and "non-winner" in x.message for x in v)


def test_i2_pending_abort_is_allowed_unless_settled():
    s = replace_in(committed_world(), "leases", 2, state=LeaseState.ABORTING, resolved_at=None)
    s = replace_in(s, "transactional_ids", 1, state=TransactionalIdState.LEASED, lease_id=3)
    assert check_invariants(s) == []
    only(check_invariants(s, settled=True), "I2")


def test_i2_commit_outside_the_decided_attempt():
    s = replace_in(committed_world(), "leases", 0, state=LeaseState.COMMITTED, producer_id=1, producer_epoch=0,
                   records=3, partition=2)
    v = check_invariants(s)
    assert any(x.invariant == "I2" and "outside the decided attempt" in x.message for x in v)


def test_i2_committed_lease_in_open_checkpoint():
    s = replace_in(committed_world(), "leases", 4, state=LeaseState.COMMITTED, records=1, resolved_at=T0 + ms(20_000))
    s = replace_in(s, "transactional_ids", 0, state=TransactionalIdState.FREE, lease_id=None)
    v = check_invariants(s)
    assert any(x.invariant == "I2" and "open checkpoint" in x.message for x in v)


def test_i2_committed_without_records_and_beyond_partition_count():
    s = replace_in(committed_world(), "leases", 3, records=0)
    assert any("no records" in x.message for x in only(check_invariants(s), "I2"))
    s = replace_in(committed_world(), "attempts", 1, partitions=1)
    assert any("beyond its count" in x.message for x in only(check_invariants(s), "I2"))


def test_i2_committed_checkpoint_with_winner_still_committing():
    s = replace_in(committed_world(), "leases", 1, state=LeaseState.COMMITTING, resolved_at=None)
    s = replace_in(s, "transactional_ids", 0, lease_id=2)  # keeps the pool bookkeeping plausible
    v = check_invariants(s)
    assert any(x.invariant == "I2" and "still COMMITTING" in x.message for x in v)


def test_i3_id_leased_twice():
    # the open attempt's lease takes p-1 while batch 0's loser on p-1 is still ABORTING
    s = replace_in(committed_world(), "leases", 2, state=LeaseState.ABORTING, resolved_at=None)
    s = replace_in(s, "leases", 4, transactional_id="p-1")
    s = replace_in(s, "transactional_ids", 0, state=TransactionalIdState.FREE, lease_id=None)
    s = replace_in(s, "transactional_ids", 1, state=TransactionalIdState.LEASED, lease_id=5)
    v = only(check_invariants(s), "I3")
    assert any("held by 2 unresolved leases" in x.message for x in v)
    assert any("before lease 3 was resolved" in x.message for x in v)


def test_i3_unresolved_lease_on_a_free_id():
    s = replace_in(committed_world(), "transactional_ids", 0, state=TransactionalIdState.FREE, lease_id=None)
    v = only(check_invariants(s), "I3")
    assert any("may hold a transaction of lease 5" in x.message for x in v)


def test_i3_leased_id_without_holder():
    s = replace_in(committed_world(), "transactional_ids", 1, state=TransactionalIdState.LEASED, lease_id=3)
    v = only(check_invariants(s), "I3")
    assert any("LEASED but no unresolved lease" in x.message for x in v)


def test_i3_re_leased_before_resolution_in_history():
    # the aborted lease on p-0 was resolved only after p-0 was leased again
    s = replace_in(committed_world(), "leases", 0, resolved_at=T0 + ms(800))
    v = only(check_invariants(s), "I3")
    assert any("leased to 2 before lease 1 was resolved" in x.message for x in v)


def test_i4_decided_within_the_margin():
    # decided 1 ms inside the margin of winner 2's deadline
    decided = T0 + ms(700 + TIMEOUT_MS - MARGIN_MS + 1)
    s = replace_in(committed_world(), "attempts", 1, decided_at=decided, finished_at=decided)
    v = only(check_invariants(s), "I4")
    assert {x.message for x in v} == {
        "lease 2 was decided within the margin of its deadline",
        "lease 4 was decided within the margin of its deadline",
    }
    # exactly at the margin is fine
    edge = T0 + ms(700 + TIMEOUT_MS - MARGIN_MS)
    assert check_invariants(replace_in(committed_world(), "attempts", 1, decided_at=edge)) == []


def test_i4_winner_without_decision_time():
    s = replace_in(committed_world(), "attempts", 1, decided_at=None)
    assert any(x.invariant == "I4" and "no decision time" in x.message for x in check_invariants(s))


def test_i5_check_unchanged():
    s = committed_world()
    assert check_unchanged(s, committed_world()) == []
    changed = replace_in(s, "leases", 4, state=LeaseState.ABORTING)
    v = check_unchanged(s, changed)
    assert [x.invariant for x in v] == ["I5"] and "leases" in v[0].message
    v = check_unchanged(s, replace_in(s, "sinks", 0, generation=2))
    assert "sinks" in v[0].message


def test_variants_are_copies_with_the_named_fields_set_as_with_changes_would() -> None:
    base = lease(id=1, partition=0, transactional_id="tx-0")
    made = base.variants(("id", "partition", "transactional_id"), [(5, 1, "tx-1"), (6, 2, "tx-2")])
    assert made == [base.with_changes(id=5, partition=1, transactional_id="tx-1"),
                    base.with_changes(id=6, partition=2, transactional_id="tx-2")]
    assert base.id == 1 and made[0] is not made[1]
    with pytest.raises(TypeError, match="not fields of Lease"):
        base.variants(("id", "nope"), [(1, 2)])
    with pytest.raises(ValueError, match="3 values for the fields"):
        base.variants(("id", "partition"), [(1, 2, 3)])


def test_all_with_changes_is_with_changes_for_each() -> None:
    leases = [lease(id=1, partition=0), lease(id=2, partition=1)]
    made = Lease.all_with_changes(iter(leases), state=LeaseState.COMMITTED, resolved_at=T0)
    assert made == [x.with_changes(state=LeaseState.COMMITTED, resolved_at=T0) for x in leases]
    assert all(a is not b for a, b in zip(made, leases)) and leases[0].state is not LeaseState.COMMITTED
    with pytest.raises(TypeError, match="not fields of Lease"):
        Lease.all_with_changes(leases, nope=1)
    with pytest.raises(TypeError, match="is not a Lease"):
        Lease.all_with_changes([object()], state=LeaseState.COMMITTED)  # type: ignore[list-item]
