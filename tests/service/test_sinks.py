"""A sink's life through `Coordinator` (real Postgres, record-only Kafka, manual clock):
registration (validated, idempotent, prefixes that never clash), generations that fence older
drivers, and the lineage that binds a sink to one Spark query (mismatch refused, operator reset).
Retirement and lost data have files of their own (test_retire.py, test_lost_data.py)."""

from __future__ import annotations

import pytest

from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.invariants import check_committed_unchanged
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import LeaseState
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from fixtures.protocol_calls import (  # noqa: F401 - fixtures
    ACTOR,
    MARGIN_MS,
    NAME,
    TIMEOUT_MS,
    assert_invariants,
    claimed,
    counts,
    event_kinds,
    ids_of,
    invariants_hold_at_the_end,
    kafka_calls,
    lease_state,
    pools,
    refused,
    spec,
    start,
    won,
)


def test_registration_answers_the_sink_and_a_retry_answers_the_same(coordinator: Coordinator,
                                                                   kafka: RecordingControlPlane):
    c = coordinator
    sink, created = c.register_sink(spec(), ACTOR)
    assert created and sink.name == NAME and sink.generation == 0 and sink.lineage_query_id is None
    assert sink.commit_margin_ms == MARGIN_MS and sink.transaction_timeout_ms == TIMEOUT_MS
    assert sink.max_pool_size == 4 * 256  # four ids per partition the coordinator allows
    assert pools(c.engine) == [(sink.id, 0, 0)]  # an empty pool: it grows on demand
    rows = counts(c.engine)
    assert c.register_sink(spec(), ACTOR) == (sink, False)
    assert counts(c.engine) == rows
    refused(c, kafka, lambda: c.register_sink(spec(transaction_timeout_ms=30_000), ACTOR), e.SINK_EXISTS)


def test_prefix_clash_between_sinks_is_refused(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    c.register_sink(spec("a", "orders-eos"), ACTOR)
    for prefix in ("orders-eos", "orders-eos-eu", "orders", "o"):
        err = refused(c, kafka, lambda: c.register_sink(spec("b", prefix), ACTOR), e.PREFIX_CLASH)
        assert err.detail == {"other_sink": "a"}
    sink, created = c.register_sink(spec("b", "orders-eu"), ACTOR)
    assert created and sink.transactional_id_prefix == "orders-eu"
    assert [s.name for s in c.list_sinks()] == ["a", "b"]


def test_sink_configuration_is_validated(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    refused(c, kafka, lambda: c.register_sink(spec(transaction_timeout_ms=900_001), ACTOR),
            "transaction_timeout_above_broker_max", e.Invalid)
    refused(c, kafka, lambda: c.register_sink(spec(commit_margin_ms=60_000), ACTOR), "commit_margin_too_large", e.Invalid)
    refused(c, kafka, lambda: c.register_sink(spec(commit_margin_ms=-1), ACTOR), "commit_margin_negative", e.Invalid)
    refused(c, kafka, lambda: c.register_sink(spec(prefix="bad prefix"), ACTOR),
            "invalid_transactional_id_prefix", e.Invalid)
    refused(c, kafka, lambda: c.register_sink(spec(name="bad/name"), ACTOR), "invalid_sink_name", e.Invalid)


def test_a_new_sink_whose_broker_fails_its_checks_is_refused(coordinator: Coordinator, kafka: RecordingControlPlane):
    from coordinator.kafka.control_plane import BrokerCheck

    c = coordinator
    kafka.broker_checks = [BrokerCheck("transactions", False, "the broker has no transaction coordinator", "fix it")]
    err = refused(c, kafka, lambda: c.register_sink(spec(), ACTOR), "broker_check_failed", e.Invalid)
    assert "transactions: the broker has no transaction coordinator (fix: fix it)" in err.message
    sink, created = c.register_sink(spec(), ACTOR, check_broker=False)
    assert created
    assert c.register_sink(spec(), ACTOR) == (sink, False)  # a retry answers from the record, whatever the broker


def test_every_call_naming_an_unknown_sink_is_404(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    start(c)
    for call in (lambda: c.start_generation("nope", "q", "r", ACTOR),
                 lambda: c.begin_checkpoint("nope", 0, 1, ACTOR),
                 lambda: c.lease("nope", 0, 1, 1, 0, 1),
                 lambda: c.commit("nope", 0, 1, 1, [], ACTOR),
                 lambda: c.resume("nope", 0),
                 lambda: c.abort_attempt("nope", 0, 1, 1, "x", ACTOR),
                 lambda: c.reset_lineage("nope", ACTOR, "x"),
                 lambda: c.retire_sink("nope", ACTOR, "x")):
        refused(c, kafka, call, "unknown_sink", e.NotFound)


# --- generations -----------------------------------------------------------------------------


def test_start_generation_retry_answers_the_same(coordinator: Coordinator, clock: ManualClock):
    c = coordinator
    c.register_sink(spec(), ACTOR)
    gen, _ = c.start_generation(NAME, "q1", "r1", ACTOR)
    assert gen == 1 and c.get_sink(NAME).lineage_query_id == "q1"
    rows = counts(c.engine)
    clock.advance(ms=5)
    assert c.start_generation(NAME, "q1", "r1", ACTOR)[0] == gen
    assert counts(c.engine) == rows and c.get_sink(NAME).generation == gen


def test_start_generation_retry_after_a_newer_generation_is_fenced(
    coordinator: Coordinator, kafka: RecordingControlPlane
):
    c = coordinator
    g1 = start(c)
    g2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)
    assert g2 == g1 + 1
    refused(c, kafka, lambda: c.start_generation(NAME, "q1", "r1", ACTOR), e.STALE_GENERATION)
    assert c.start_generation(NAME, "q1", "r2", ACTOR)[0] == g2


def test_start_generation_retry_answers_the_same_aborts(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c)
    c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=4)
    tries = claimed(c, 0, 1, g1, 3)  # partition 3's pre-lease unclaimed: nothing to abort on Kafka
    first = c.start_generation(NAME, "q1", "r2", ACTOR)
    calls = kafka_calls(kafka)
    again = c.start_generation(NAME, "q1", "r2", ACTOR)
    assert first == again
    assert sorted(first[1].aborted) == ids_of(tries) and first[1].pending == []
    assert kafka_calls(kafka) == calls  # the retry aborted nothing a second time
    d = c.checkpoint_detail(NAME, 0)
    assert d.attempts[0].abort_reason == "fenced_by_generation_2"
    assert {x.state for x in d.leases} == {LeaseState.ABORTED}


# --- lineage ---------------------------------------------------------------------------------


def test_lineage_mismatch_and_reset(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c, query="q1")
    c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=1)
    (x,) = claimed(c, 0, 1, g1, 1)
    c.commit(NAME, 0, 1, g1, [won(x)], ACTOR)
    c.begin_checkpoint(NAME, 1, g1, ACTOR, partitions=1)
    (open_lease,) = claimed(c, 1, 1, g1, 1)

    # a query from a fresh checkpoint location (batch ids restart at 0) is refused, not skipped
    err = refused(c, kafka, lambda: c.start_generation(NAME, "q2", "r9", ACTOR), e.LINEAGE_MISMATCH)
    assert err.detail == {"bound_query_id": "q1", "query_id": "q2"}

    committed = c.snapshot()
    sink = c.reset_lineage(NAME, "operator", "new checkpoint location")
    assert sink.lineage_query_id is None and sink.generation == g1 + 1
    assert lease_state(c, open_lease.id) is LeaseState.ABORTED
    assert (NAME, open_lease.transactional_id) in kafka.aborts
    assert "lineage_reset" in event_kinds(c)
    # the old driver is fenced; nobody holds the reset's own generation
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 2, g1, ACTOR), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 0, sink.generation, ACTOR), e.LINEAGE_NOT_BOUND)

    g3, _ = c.start_generation(NAME, "q2", "r9", ACTOR)
    assert g3 == sink.generation + 1 and c.get_sink(NAME).lineage_query_id == "q2"
    begun = c.begin_checkpoint(NAME, 0, g3, ACTOR, partitions=1)
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.must_write  # not skipped: a new lineage
    assert begun.checkpoint.query_id == "q2" and begun.attempt.number == 1
    (y,) = claimed(c, 0, 1, g3, 1)
    c.commit(NAME, 0, 1, g3, [won(y)], ACTOR)
    assert check_committed_unchanged(committed, c.snapshot()) == []
    assert [cp.query_id for cp in c.list_checkpoints(NAME)] == ["q2"]
    # the old query now is the stranger
    refused(c, kafka, lambda: c.start_generation(NAME, "q1", "r10", ACTOR), e.LINEAGE_MISMATCH)
    assert_invariants(c, settled=True)


def test_reset_lineage_refused_while_a_commit_is_finishing(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    (x,) = claimed(c, 0, 1, gen, 1)
    kafka.fail_next(ControlPlaneError("broker unreachable", retriable=True))
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, 1, gen, [won(x)], ACTOR)
    err = refused(c, kafka, lambda: c.reset_lineage(NAME, "operator", "oops"), e.COMMIT_IN_PROGRESS)
    assert err.detail == {"batch_ids": [0]}
    c.resume(NAME, 0)
    sink = c.reset_lineage(NAME, "operator", "now")
    assert sink.lineage_query_id is None
    assert_invariants(c, settled=True)


def test_rotating_the_writer_token_bumps_its_version(coordinator: Coordinator):
    c = coordinator
    sink, _ = c.register_sink(spec(), ACTOR)
    assert c.rotate_writer_token(NAME, "admin").writer_token_version == sink.writer_token_version + 1
    assert "writer_token_rotated" in event_kinds(c)
