"""The deterministic fault-injection simulation (sim/): 120 seeded schedules against the real
coordinator and Postgres with the Kafka model, each fault kind of issues 15 and 50 shown to lose
nothing, and deliberately broken coordinators, clients and deployments the checker must catch.
The model itself is tests/sim/test_kafka_model.py's."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine

from coordinator.kafka.control_plane import ControlPlaneError
from coordinator.protocol import configuration, rules
from coordinator.store import pool
from sim import broken, runner
from sim.faults import FaultConfig
from sim.kafka_model import ModelControlPlane
from sim.runner import ScheduleResult, run_one

SCHEDULES = 120  # the default run's share; `python -m sim soak --schedules 2000` runs thousands


@pytest.fixture(autouse=True)
def quiet_coordinator_logs() -> Iterator[None]:
    # every injected failure is logged loudly by the service; thousands of lines slow the run
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


# --- (a) the seeded schedules ---------------------------------------------------------------------


@pytest.mark.timeout(1500)  # ~1-2 min on an idle 2-core machine, 10+ min when it is shared
def test_seeded_schedules_keep_every_invariant(engine: Engine) -> None:
    results = [run_one(engine, seed, FaultConfig()) for seed in range(SCHEDULES)]
    faults: Counter[str] = Counter()
    for r in results:
        faults.update(r.faults)
    bad = [r for r in results if not r.ok]
    print(f"\n{len(results)} schedules, {sum(r.committed for r in results)} batches committed, faults: "
          + ", ".join(f"{k}={v}" for k, v in sorted(faults.items())))
    assert not bad, "\n\n".join(r.report() for r in bad[:3])
    # the faults really happened, every kind of them, at a useful rate
    for kind in ("driver_crash", "zombie_driver", "executor_crash", "speculative_task", "coordinator_crash",
                 "db_failure", "request_fail", "lost_response", "duplicate_request", "kafka_fail",
                 "kafka_lost_response", "kafka_delay", "near_timeout", "leader_failover", "two_replicas",
                 "orphaned_commit", "driver_down_long", "zombie_executor", "clock_skew", "checkpoint_restore",
                 "kafka_unexpected_error", "end_txn_lost_reinit", "stage_retry", "unreachable_neighbours",
                 "begin_race", "retire_race", "history_prune"):
        assert faults[kind] >= 5, (kind, faults)
    assert sum(r.committed for r in results) == sum(r.batches for r in results)


def test_a_seed_replays_the_same_schedule(engine: Engine) -> None:
    for seed in (3, 17, 42):
        first = run_one(engine, seed, FaultConfig(), keep_on_failure=False)
        again = run_one(engine, seed, FaultConfig(), keep_on_failure=False)
        assert first.fault_list == again.fault_list
        assert first.trace == again.trace
        assert first.fault_list, "a schedule without faults proves little"


# --- (d) the checker catches deliberately broken coordinators ---------------------------------------


def first_violation(engine: Engine, config: FaultConfig, seeds: range) -> ScheduleResult | None:
    for seed in seeds:
        r = run_one(engine, seed, config, keep_on_failure=False)
        if not r.ok:
            return r
    return None


def test_checker_catches_commit_without_the_timeout_gate(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "check_commit_deadlines", lambda winners, now, margin_ms: None)
    found = first_violation(engine, FaultConfig().scaled(near_timeout=0.5), range(1000, 1040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith(("I4", "I7", "LIVENESS")) for v in found.violations), found.report()


def test_the_database_refuses_re_leasing_an_id_that_holds_an_open_transaction(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken variant: the pool forgets which ids unresolved leases hold (only the quarantine
    keeps ids out). The database's own unique index over unresolved leases refuses the grant: I3
    holds even against such a bug, and the schedule stops on the refusal, naming the index."""
    def quarantine_only(conn, sink_id, now):  # type: ignore[no-untyped-def]
        return {q.ordinal for q in pool.quarantines(conn) if q.sink_id == sink_id and q.until > now}

    monkeypatch.setattr(pool, "busy", quarantine_only)
    found = first_violation(engine, FaultConfig(), range(2000, 2040))
    assert found is not None, "no violation within 40 seeds"
    assert any("uq_leases_held" in v for v in found.violations), found.report()


def test_checker_catches_a_stale_generation_being_accepted(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "check_generation", lambda current, given: None)
    found = first_violation(engine, FaultConfig().scaled(driver_crash=0.1, zombie_driver=1.0), range(3000, 3040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith("I5") for v in found.violations), found.report()


def test_checker_catches_a_coordinator_that_never_aborts_on_kafka(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """I6 is checked while transactions can still be open (before quiescence moves the clock past
    every timeout, after which the broker has expired everything and I6 could never fail)."""
    monkeypatch.setattr(ModelControlPlane, "abort", lambda self, target, transactional_id: None)
    found = first_violation(engine, FaultConfig(), range(4000, 4040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith("I6: open transactions no unresolved lease explains") for v in found.violations), \
        found.report()


# --- (e) issue 15: each finding as a fault kind -----------------------------------------------------


def only(kind: str, rate: float) -> FaultConfig:
    return FaultConfig().scaled(**{kind: rate})


def test_unexpected_end_txn_errors_keep_every_invariant(engine: Engine) -> None:
    """Item 4: UNKNOWN_SERVER_ERROR, an authorization failure or an unknown code on EndTxn keeps the
    commit decided; it is retried and nothing is lost."""
    config = only("kafka_unexpected_error", 0.3)
    results = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(5000, 5020)]
    assert sum(r.faults["kafka_unexpected_error"] for r in results) >= 10
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()


def test_checker_catches_treating_every_refusal_as_final(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 4's broken variant: any non-retriable answer ends the commit (the landed code before the fix).
    The log check before LOST (item 5) would find such a transaction still open and keep the commit,
    so it is switched off too: this is the landed code's behaviour, which declared LOST at once."""
    monkeypatch.setattr(ControlPlaneError, "transaction_gone", property(lambda self: not self.retriable))
    no_offsets(monkeypatch)
    found = first_violation(engine, only("kafka_unexpected_error", 0.3), range(5000, 5040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith(("LOST", "FALSE LOST")) for v in found.violations), found.report()


# Items 1, 2, 3 and 5: with the fixes (quarantine of ids freed from undecided tries longer than a
# stalled try can reach the broker, one clock, offsets bound at begin, first offsets in the
# pre-commit record) the fault kind loses nothing; with each fix disabled the checker finds the loss.


def first_violation_kw(engine: Engine, config: FaultConfig, seeds: range, **kw: object) -> ScheduleResult | None:
    for seed in seeds:
        r = run_one(engine, seed, config, keep_on_failure=False, **kw)
        if not r.ok:
            return r
    return None


def test_checker_catches_ids_reused_without_quarantine(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.service.results import Limits

    monkeypatch.setattr(configuration, "validate_quarantine", lambda *a: None)
    monkeypatch.setattr(Limits, "quarantine", property(lambda self: timedelta(0)))
    outcome = ("LOST", "I7", "LIVENESS")  # what a zombie did to the output (R1, on the record, flags it earlier)
    found = next((r for seed in range(6000, 6060) for r in [run_one(engine, seed, only("zombie_executor", 0.25),
                  keep_on_failure=False)] if any(v.startswith(outcome) for v in r.violations)), None)
    assert found is not None, "no loss within 60 seeds"


def test_the_reuse_check_flags_an_id_leased_again_within_reach_whatever_kafka_saw(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R1 reads the record alone: with the quarantine off, an id freed from an undecided try and
    leased again within the reach of a stalled try is flagged even in schedules where no zombie
    happened to act (the outcome checks above need one to); with the quarantine on it never is."""
    from coordinator.service.results import Limits

    config = only("zombie_executor", 0.25)
    kept = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(6100, 6110)]
    assert not [v for r in kept for v in r.violations if v.startswith("R1")]
    monkeypatch.setattr(configuration, "validate_quarantine", lambda *a: None)
    monkeypatch.setattr(Limits, "quarantine", property(lambda self: timedelta(0)))
    found = first_violation(engine, config, range(6100, 6160))
    assert found is not None, "no violation within 60 seeds"
    assert any(v.startswith("R1") for v in found.violations), found.report()


def loop_finishes(result: ScheduleResult) -> int:
    """How many times the schedule's recovery loop committed a decision while the driver was down."""
    return sum(1 for line in result.trace if "recovery (" in line and "while the driver is down" in line
               and "committed=" in line)


def test_the_recovery_loop_finishes_an_orphaned_commit_within_the_timeout(engine: Engine) -> None:
    """The driver dies with its commit in flight, the replica deciding it dies too, and the driver
    stays down past the transaction timeout: the loop (after its grace) is the only one to finish
    the decision, and must before the broker aborts it."""
    config = FaultConfig().scaled(orphaned_commit=0.3, driver_down_long=0.5)
    results = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(9500, 9530)]
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()
    assert sum(loop_finishes(r) for r in results) >= 3, "the loop never finished an orphaned commit"


def test_checker_catches_a_recovery_grace_past_the_transaction_timeout(engine: Engine) -> None:
    """The broken variant: the loop leaves decisions to their (dead) callers for longer than the
    transaction timeout, so the broker aborts them first and the decided batches are lost."""
    config = FaultConfig().scaled(orphaned_commit=0.3, driver_down_long=0.5)
    found = first_violation_kw(engine, config, range(9500, 9540),
                               recovery_grace_ms=runner.TIMEOUT_MS + runner.MARGIN_MS)
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith(("LOST", "I4", "I7")) for v in found.violations), found.report()


def test_checker_catches_replicas_deciding_on_their_own_clocks(engine: Engine) -> None:
    found = first_violation_kw(engine, only("clock_skew", 1.0).scaled(two_replicas=1.0), range(7000, 7040),
                               one_clock=False)
    assert found is not None, "no violation within 40 seeds"


def test_checker_catches_a_replay_over_other_offsets_being_skipped(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "check_offsets", lambda *a, **k: True)
    found = first_violation(engine, only("checkpoint_restore", 0.5), range(8000, 8040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith("I7") for v in found.violations), found.report()


def no_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The landed code before the log check: no first offsets to read, so every refusal that means
    a transaction is gone is taken as the loss."""
    monkeypatch.setattr("coordinator.service.commit_outcomes.first_offsets", lambda lease: [])
    monkeypatch.setattr("coordinator.service.committer.first_offsets", lambda lease: [])


def test_checker_catches_a_loss_declared_without_reading_the_log(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    no_offsets(monkeypatch)
    found = first_violation(engine, only("end_txn_lost_reinit", 0.2), range(9000, 9040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith("FALSE LOST") for v in found.violations), found.report()


def test_stalled_executors_whose_init_lands_late_lose_nothing(engine: Engine) -> None:
    found = first_violation(engine, only("zombie_executor", 0.25), range(6000, 6040))
    assert found is None, found.report()


def test_a_lost_stage_attempt_whose_tries_wrote_or_stalled_loses_nothing(engine: Engine) -> None:
    """Issue 50 §2: a stage resubmitted after its tries ran (some wrote and were thrown away, some
    stalled before InitProducerId and land later), seen by the client as PySpark shows it (no stage
    attempt number: the new stage's tries look like first tries): the coordinator's claims keep
    every try on an id of its own."""
    results = [run_one(engine, seed, only("stage_retry", 0.4), keep_on_failure=False) for seed in range(6200, 6230)]
    assert sum(r.faults.get("stage_retry", 0) for r in results) >= 10
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()


def test_checker_catches_a_stage_retry_on_the_landed_clients_guess_of_first_tries(engine: Engine) -> None:
    """The broken variant (sim/broken.py): the landed client named a try of attempt number 0 "the
    first try", a resubmitted stage's too, so it wrote on the pre-lease a stalled try of the lost
    stage still held; that zombie's InitProducerId then fences a later user of the id."""
    found = first_violation_kw(engine, FaultConfig().heavy(stage_retry=0.5, zombie_executor=0.1), range(0, 40),
                               guessed_first_tries=True)
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith(("LOST", "I7", "LIVENESS", "R1")) for v in found.violations), found.report()


# --- (f) issue 50: sinks on an unreachable cluster, begins racing a new generation or a retirement ----


def test_sinks_on_an_unreachable_cluster_never_delay_another_sinks_orphaned_commits(engine: Engine) -> None:
    config = FaultConfig().heavy(unreachable_neighbours=1.0, orphaned_commit=0.3, driver_down_long=0.3)
    results = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(0, 20)]
    assert sum(r.faults.get("unreachable_neighbours", 0) for r in results) == 20
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()


def test_checker_catches_a_loop_that_serves_every_sink_in_turn(engine: Engine) -> None:
    """The broken variant: one worker runs every step of every sink in name order, as the landed
    loop did: the unreachable neighbours' calls hold an orphaned commit back past its timeout."""
    config = FaultConfig().heavy(unreachable_neighbours=1.0, orphaned_commit=0.3, driver_down_long=0.3)
    found = first_violation_kw(engine, config, range(0, 40), serial_recovery=True)
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith(("LOST", "I7")) for v in found.violations), found.report()


def test_begins_racing_a_new_generation_or_a_retirement_leave_nothing_open(engine: Engine) -> None:
    config = FaultConfig().heavy(begin_race=0.3, retire_race=1.0)
    results = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(0, 12)]
    assert sum(r.faults.get("begin_race", 0) for r in results) >= 5
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()


def test_checker_catches_a_begin_that_reads_the_sink_without_its_lock(engine: Engine) -> None:
    """The broken variant (sim/broken.py): the landed begin read the sink's row without a lock, so
    a begin racing a new generation leaves an open attempt of the fenced generation (F1), and one
    racing a retirement an open attempt on a retired sink (F2)."""
    config = FaultConfig().heavy(begin_race=0.3, retire_race=1.0)
    with broken.begin_without_the_sink_lock():
        results = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(0, 12)]
    found = [v for r in results for v in r.violations]
    assert any(v.startswith("F1") for v in found), found[:5]
    assert any(v.startswith("F2") for v in found), found[:5]


def test_replica_clock_skew_and_steps_lose_nothing(engine: Engine) -> None:
    found = first_violation(engine, only("clock_skew", 1.0).scaled(two_replicas=1.0), range(7000, 7030))
    assert found is None, found.report()


def test_a_checkpoint_restored_from_an_older_backup_loses_nothing(engine: Engine) -> None:
    found = first_violation(engine, only("checkpoint_restore", 0.5), range(8000, 8030))
    assert found is None, found.report()


def test_a_commit_applied_whose_answer_was_lost_before_a_re_init_is_not_declared_lost(engine: Engine) -> None:
    found = first_violation(engine, only("end_txn_lost_reinit", 0.2), range(9000, 9030))
    assert found is None, found.report()


def test_pruning_the_history_between_any_two_steps_loses_nothing(engine: Engine) -> None:
    """An operator prunes old batches' history at any point (faults inside it too), while Spark's
    checkpoint may be restored from an older backup: a replay of a pruned batch is still skipped
    as committed, or refused when re-planned over other offsets."""
    config = only("history_prune", 0.6).scaled(checkpoint_restore=0.5)
    results = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(8100, 8130)]
    assert sum(r.faults.get("history_prune", 0) for r in results) >= 20
    assert sum(r.faults.get("checkpoint_restore", 0) for r in results) >= 5
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()


def test_checker_catches_pruning_that_deletes_the_checkpoint_rows_too(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken variant: pruning deletes a batch's checkpoint row with its history, so a replay
    of the batch after a checkpoint restore finds no record of it and writes it again."""
    from sqlalchemy import text

    import coordinator.service.history as history

    real_prune = history.prune_history

    def prune_and_delete_rows(ctx, *args, **kwargs):  # type: ignore[no-untyped-def]
        outcome = real_prune(ctx, *args, **kwargs)
        with ctx.engine.begin() as conn:  # the rows whose history is gone go as well
            conn.execute(text("DELETE FROM checkpoints WHERE history_pruned_at IS NOT NULL"))
        return outcome

    monkeypatch.setattr(history, "prune_history", prune_and_delete_rows)
    config = only("history_prune", 0.6).scaled(checkpoint_restore=0.5)
    failed = [r for r in (run_one(engine, seed, config) for seed in range(8100, 8160)) if not r.ok]
    # every such schedule has a committed checkpoint vanish (I1's history half, when a snapshot saw
    # it committed) or writes a batch again; and some write a replayed batch twice (I7: the records
    # visible more than once)
    assert failed, "no violation within 60 seeds"
    assert all(any(v.startswith(("I1: committed checkpoint", "I7")) for v in r.violations) for r in failed), \
        failed[0].report()
    assert any(any(v.startswith("I7: records visible more than once") for v in r.violations) for r in failed), \
        failed[0].report()
