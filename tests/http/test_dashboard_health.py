"""The dashboard's health rules (coordinator/http/dashboard/health.py) and its per-batch figures
(coordinator/http/dashboard/views.py) on plain records: no database, no HTTP."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

from coordinator.http.dashboard.health import Level, Thresholds, sink_health, timeout_bars
from coordinator.http.dashboard.views import DURATIONS, bar_chart, batch_row, charts
from coordinator.protocol.model import Attempt, Checkpoint, Lease, Sink
from coordinator.protocol.states import AttemptState, CheckpointState, LeaseState
from coordinator.service import BatchSummary

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
TIMEOUT_MS = 60_000


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def sink(**kw: object) -> Sink:
    values: dict = dict(id=1, name="orders", transactional_id_prefix="orders-eos", bootstrap_servers="k:9092",
                        topics=["out"], transaction_timeout_ms=TIMEOUT_MS, commit_margin_ms=6_000, max_pool_size=16,
                        generation=3, lineage_query_id="q", writer_token_version=1, created_at=T0)
    values.update(kw)
    return Sink(**values)


def checkpoint(batch: int, state: CheckpointState, *, created: int = 0, decided: int | None = None,
               committed: int | None = None, attempt: int | None = 1) -> Checkpoint:
    return Checkpoint(id=batch + 100, sink_id=1, query_id="q", batch_id=batch, state=state, current_attempt=1,
                      committed_attempt=attempt if decided is not None else None, created_at=at(created),
                      decided_at=None if decided is None else at(decided),
                      committed_at=None if committed is None else at(committed))


def attempt(cp: Checkpoint, state: AttemptState, *, started: int = 0, decided: int | None = None, number: int = 1) -> Attempt:
    return Attempt(id=cp.id * 10 + number, checkpoint_id=cp.id, number=number, generation=3, state=state, partitions=2,
                   started_at=at(started), decided_at=None if decided is None else at(decided), finished_at=None,
                   abort_reason=None)


def lease(lid: int, state: LeaseState, *, leased: int = 0, cp_id: int = 100, attempt_id: int = 1001,
          records: int | None = None, partition: int = 0) -> Lease:
    return Lease(id=lid, sink_id=1, checkpoint_id=cp_id, attempt_id=attempt_id, partition=partition,
                 task_attempt_id=None if state is LeaseState.PRELEASED else lid, ordinal=lid,
                 transactional_id=f"orders-eos-{lid}", state=state, taken_at=at(leased), leased_at=at(leased),
                 deadline_at=at(leased + TIMEOUT_MS), producer_id=None if records is None else 500 + lid,
                 producer_epoch=None if records is None else 0, records=records,
                 bytes=None if records is None else records * 100, write_ms=None, first_offsets=None,
                 resolved_at=None)


def committed_history() -> list[tuple[Checkpoint, list[Attempt]]]:
    cp = checkpoint(7, CheckpointState.COMMITTED, created=0, decided=2_000, committed=2_300)
    return [(cp, [attempt(cp, AttemptState.COMMITTED, started=0, decided=2_000)])]


def test_a_sink_committing_normally_is_ok() -> None:
    h = sink_health(sink(), committed_history(), [], at(10_000))
    assert (h.level, h.label, h.findings) == (Level.OK, "committing normally", ())


def test_a_sink_without_batches_is_ok_but_says_so() -> None:
    assert sink_health(sink(), [], [], at(0)).label == "no batch yet"


def test_halted_sink_is_lost_data_awaiting_acknowledgement() -> None:
    h = sink_health(sink(halted_at=at(5), halted_reason="batch 7: partition 1 refused"), committed_history(), [], at(9))
    assert h.level is Level.CRITICAL and h.label == "lost data awaiting acknowledgement"
    assert "batch 7: partition 1 refused" in h.findings[0].message


def test_near_timeout_starts_at_80_percent_of_a_leased_transactions_lifetime() -> None:
    live = [lease(1, LeaseState.LEASED, leased=0)]
    assert sink_health(sink(), committed_history(), live, at(47_999)).level is Level.OK
    h = sink_health(sink(), committed_history(), live, at(48_000))  # exactly 80 %
    assert h.level is Level.WARN and h.kinds == {"near_timeout"} and h.label == "transactions near timeout"
    assert "orders-eos-1" in h.findings[0].message and "80%" in h.findings[0].message


def test_a_wide_batch_near_timeout_names_the_three_nearest_and_counts_the_rest() -> None:
    live = [lease(i, LeaseState.COMMITTING, leased=100 * i, records=1) for i in range(10, 0, -1)]  # lease 1 the oldest
    h = sink_health(sink(), committed_history(), live, at(49_000))  # all ten past 80 % of 60 s
    assert h.kinds == {"near_timeout"}
    assert [f.message.split(" ")[0] for f in h.findings[:3]] == ["orders-eos-1", "orders-eos-2", "orders-eos-3"]
    assert [f.message for f in h.findings[3:]] == ["and 7 more transaction(s) past 80% of the timeout"]


def test_a_pre_lease_no_try_claimed_is_not_near_timeout() -> None:
    # the recovery loop's rule: only transactions a try holds, or decided ones, can be lost by the
    # timeout; a pre-lease has no producer yet (and one being aborted is on its way out)
    for state in (LeaseState.PRELEASED, LeaseState.ABORTING):
        assert sink_health(sink(), committed_history(), [lease(1, state)], at(59_000)).level is Level.OK, state
    h = sink_health(sink(), committed_history(), [lease(1, LeaseState.COMMITTING, records=3)], at(59_000))
    assert h.kinds == {"near_timeout"} and "COMMITTING" in h.findings[0].message


def test_stuck_partitions_are_critical_and_outrank_warnings() -> None:
    live = [lease(1, LeaseState.LEASED)]
    h = sink_health(sink(), committed_history(), live, at(50_000), stuck_partitions=2, lingering=1)
    assert h.level is Level.CRITICAL and h.label == "stuck consumers"
    assert [f.kind for f in h.findings] == ["stuck", "near_timeout", "lingering"]


def test_lingering_transactions_warn() -> None:
    h = sink_health(sink(), committed_history(), [], at(1), lingering=3)
    assert (h.level, h.label) == (Level.WARN, "lingering transactions") and "3 open" in h.findings[0].message


def test_a_decided_commit_unfinished_too_long_is_slow() -> None:
    cp = checkpoint(8, CheckpointState.COMMITTING, decided=1_000)
    history = [(cp, [attempt(cp, AttemptState.COMMITTING, decided=1_000)]), *committed_history()]
    th = Thresholds(slow_commit_ms=30_000)
    assert sink_health(sink(), history, [], at(31_000), thresholds=th).level is Level.OK
    h = sink_health(sink(), history, [], at(31_001), thresholds=th)
    assert h.kinds == {"slow"} and "batch 8" in h.findings[0].message


def test_a_batch_taking_over_half_the_timeout_is_slow() -> None:
    cp = checkpoint(9, CheckpointState.COMMITTED, decided=30_001, committed=30_100)
    h = sink_health(sink(), [(cp, [attempt(cp, AttemptState.COMMITTED, decided=30_001)])], [], at(31_000))
    assert h.kinds == {"slow"} and "30001 ms" in h.findings[0].message
    cp = checkpoint(9, CheckpointState.COMMITTED, decided=30_000, committed=30_100)
    assert sink_health(sink(), [(cp, [attempt(cp, AttemptState.COMMITTED, decided=30_000)])], [], at(31_000)).level is Level.OK


def test_timeout_bars_show_age_against_the_timeout() -> None:
    bars = timeout_bars([lease(1, LeaseState.LEASED, leased=0), lease(2, LeaseState.COMMITTING, leased=-10_000),
                         lease(3, LeaseState.ABORTING, leased=-70_000)], at(50_000), TIMEOUT_MS)
    assert [(b.lease.id, b.percent, b.level, b.width) for b in bars] == [
        (3, 200.0, Level.CRITICAL, 100.0),  # past its timeout: the broker has aborted it
        (2, 100.0, Level.CRITICAL, 100.0),
        (1, 83.3, Level.WARN, 83.3),
    ]
    assert bars[2].age_ms == 50_000


def test_batch_durations_come_from_the_decided_attempt_and_charts_leave_out_undecided_batches() -> None:
    cp = checkpoint(4, CheckpointState.COMMITTED, created=0, decided=1_500, committed=1_800, attempt=2)
    first = attempt(cp, AttemptState.ABORTED, number=1)
    second = attempt(cp, AttemptState.COMMITTED, started=500, decided=1_500, number=2)
    row = batch_row(BatchSummary(cp, [first, second], 42, 4200))  # the sums are Postgres' (test_dashboard_http)
    assert row.durations == {"batch_ms": 1_000, "job_ms": None, "commit_ms": 300, "total_ms": 1_800}
    assert [k for k, _, _ in DURATIONS] == list(row.durations)

    open_cp = checkpoint(5, CheckpointState.OPEN)
    undecided = batch_row(BatchSummary(open_cp, [attempt(open_cp, AttemptState.OPEN)], None, None))
    assert undecided.records is None and undecided.durations["commit_ms"] is None
    # charts: oldest batch first, undecided batches left out
    by_key = {ch.key: ch for ch in charts([undecided, row])}
    assert [(b.label, b.value) for b in by_key["records"].bars] == [("4", 42)]
    assert [(b.label, b.value) for b in by_key["commit_ms"].bars] == [("4", 300)]
    assert by_key["records_per_s"].bars == []  # no job time reported: no throughput bar


def test_throughput_is_records_over_the_drivers_job_time() -> None:
    cp = checkpoint(6, CheckpointState.COMMITTED, created=0, decided=1_500, committed=1_800)
    decided = dataclasses.replace(attempt(cp, AttemptState.COMMITTED, decided=1_500), job_ms=400)
    row = batch_row(BatchSummary(cp, [decided], 1_000, 10_000))
    assert row.durations["job_ms"] == 400
    by_key = {ch.key: ch for ch in charts([row])}
    assert [(b.label, b.value) for b in by_key["records_per_s"].bars] == [("6", 2_500.0)]
    assert [(b.label, b.value) for b in by_key["job_ms"].bars] == [("6", 400)]


def test_bar_chart_scales_to_the_largest_value() -> None:
    ch = bar_chart("records", "records", "records", [("1", 50), ("2", None), ("3", 100)])
    assert [b.label for b in ch.bars] == ["1", "3"] and ch.max_value == 100
    tall, half = ch.bars[1], ch.bars[0]
    assert tall.height == ch.HEIGHT - 20 and half.height == (ch.HEIGHT - 20) / 2
    assert tall.y + tall.height == ch.HEIGHT
