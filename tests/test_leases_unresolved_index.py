"""Lease state changes between unresolved states are HOT updates (migration 0008): no index covers
`state`; "unresolved" is `resolved_at IS NULL` (a CHECK keeps it equal to the unresolved states),
the partial index ix_lease_rows_unresolved is on it, and the queries for unresolved leases use it
through the view unresolved_leases, whose first tries come from unfinished attempts only
(ix_attempts_open, migration 0012)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import IntegrityError

from coordinator.protocol import errors as e
from coordinator.protocol.rules import PrecommitRequest
from coordinator.service import Coordinator, SinkSpec
from coordinator.service.metrics import DatabaseCollector
from coordinator.service.recovery import RecoveryLoop
from coordinator.store.db import downgrade, migrate

NAME = "clicks"
RESOLVED_CHECKPOINTS = 2500  # two resolved leases each


def _start(c: Coordinator) -> int:
    c.register_sink(SinkSpec(name=NAME, transactional_id_prefix="clicks-eos", bootstrap_servers="kafka:9092",
                             topics=["out"], transaction_timeout_ms=60_000), "test")
    gen, _ = c.start_generation(NAME, "query-1", "run-1", "test")
    return gen


def _add_resolved_history(engine: Engine, sink_id: int, generation: int) -> None:
    """Committed batches with their leases, as a sink has after running a while: first tries on
    the attempt rows (the common path) and a retry's lease row each."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO checkpoints (sink_id, query_id, batch_id, state, current_attempt, committed_attempt, "
            "created_at, decided_at, committed_at) "
            "SELECT :sink, 'query-1', b, 'COMMITTED', 1, 1, now(), now(), now() FROM generate_series(1000, 999 + :n) b"
        ), {"sink": sink_id, "n": RESOLVED_CHECKPOINTS})
        conn.execute(text(
            "INSERT INTO attempts (checkpoint_id, sink_id, number, generation, state, partitions, started_at, "
            "decided_at, finished_at, first_tids, first_deadline_at, first_records) "
            "SELECT id, sink_id, 1, :gen, 'COMMITTED', 2, now(), now(), now(), ARRAY['clicks-eos-0', 'clicks-eos-1'], "
            "now(), CAST('[[1, 0, 5, 50, 3, null], null]' AS json) "
            "FROM checkpoints WHERE sink_id = :sink AND batch_id >= 1000"
        ), {"sink": sink_id, "gen": generation})
        conn.execute(text(
            "INSERT INTO lease_rows (sink_id, checkpoint_id, attempt_id, partition, task_attempt_id, "
            "transactional_id, state, leased_at, deadline_at, precommitted_at, resolved_at) "
            "SELECT a.sink_id, a.checkpoint_id, a.id, 1, 0, 'clicks-eos-2', 'COMMITTED', now(), "
            "now() + interval '1 minute', now(), now() FROM attempts a "
            "WHERE a.sink_id = :sink AND a.state = 'COMMITTED'"
        ), {"sink": sink_id})
        conn.execute(text("ANALYZE"))


def _lease_row(state: str, resolved: bool) -> dict[str, Any]:
    return {"state": state, "resolved_at": "2026-01-01T00:00:00Z" if resolved else None}


_INSERT_LEASE = text(
    "INSERT INTO lease_rows (sink_id, checkpoint_id, attempt_id, partition, task_attempt_id, transactional_id, "
    "state, leased_at, deadline_at, resolved_at) SELECT l.sink_id, l.checkpoint_id, l.attempt_id, l.partition, 77, "
    "l.transactional_id, :state, now(), now(), CAST(:resolved_at AS timestamptz) FROM lease_rows l LIMIT 1"
)


@pytest.mark.parametrize(("state", "resolved"), [
    ("COMMITTED", False), ("ABORTED", False), ("LOST", False),
    ("LEASED", True), ("PRECOMMITTED", True), ("COMMITTING", True), ("ABORTING", True), ("LOST_ABORTING", True),
])
def test_resolved_at_is_set_exactly_on_the_end_states(coordinator: Coordinator, engine: Engine, state: str,
                                                       resolved: bool) -> None:
    gen = _start(coordinator)
    attempt = coordinator.begin_checkpoint(NAME, 0, gen, "test").attempt
    assert attempt is not None
    coordinator.begin_partition(NAME, 0, attempt.number, gen, 0, 1)
    with pytest.raises(IntegrityError, match="ck_lease_rows_resolved"), engine.begin() as conn:
        conn.execute(_INSERT_LEASE, _lease_row(state, resolved))
    with engine.begin() as conn:  # the consistent variant of the same row is accepted
        conn.execute(_INSERT_LEASE, _lease_row(state, not resolved))


def test_migration_fills_in_resolved_at_of_old_end_state_leases(database_url: str, engine: Engine) -> None:
    c = Coordinator(engine, None)
    try:
        gen = _start(c)
        attempt = c.begin_checkpoint(NAME, 0, gen, "test").attempt
        assert attempt is not None
        leased = c.begin_partition(NAME, 0, attempt.number, gen, 0, 1)
        precommitted = c.precommit(NAME, c.begin_partition(NAME, 0, attempt.number, gen, 1, 2).id, gen,
                                   PrecommitRequest(9001, 0, 5, 500))
    finally:
        c.close()
    downgrade(database_url, "0007")
    with engine.begin() as conn:  # as an older version could leave them: end states without resolved_at
        conn.execute(text("UPDATE leases SET state = 'ABORTED' WHERE id = :id"), {"id": leased.id})
        conn.execute(text("UPDATE leases SET state = 'COMMITTED' WHERE id = :id"), {"id": precommitted.id})
    migrate(database_url)
    with engine.connect() as conn:
        got = dict(conn.execute(text("SELECT id, resolved_at FROM leases")).all())
    assert got == {leased.id: leased.leased_at, precommitted.id: precommitted.precommitted_at}
    assert precommitted.precommitted_at != leased.leased_at


def test_queries_for_unresolved_leases_use_the_partial_index(coordinator: Coordinator, engine: Engine) -> None:
    """With thousands of resolved leases and a few unresolved ones, every query that asks for
    unresolved leases reads the view unresolved_leases: ix_lease_rows_unresolved for the lease rows
    (the expired-lease query may go through the open attempts instead) and ix_attempts_open for the
    first tries on attempt rows; none scans lease_rows or attempts."""
    gen = _start(coordinator)
    attempt = coordinator.begin_checkpoint(NAME, 0, gen, "test").attempt
    assert attempt is not None
    coordinator.begin_partition(NAME, 0, attempt.number, gen, 0, 1)
    x = coordinator.begin_partition(NAME, 0, attempt.number, gen, 1, 2)
    coordinator.precommit(NAME, x.id, gen, PrecommitRequest(9001, 0, 5, 500))
    _add_resolved_history(engine, coordinator.get_sink(NAME).id, gen)

    def retire() -> None:
        with pytest.raises(e.Conflict):
            coordinator.retire_sink(NAME, "test", "blocked by its open leases")

    loop = RecoveryLoop(coordinator, interval_ms=50, leader_ttl_ms=10_000, holder="replica-a")
    operations: dict[str, Callable[[], object]] = {
        "recovery idle check": loop.run_once,
        "possibly_open_transactions": lambda: coordinator.possibly_open_transactions(NAME),
        "run_pending_aborts": lambda: coordinator.run_pending_aborts(NAME),
        "abort_expired_leases": lambda: coordinator.abort_expired_leases(NAME),
        "warn_near_timeout": lambda: coordinator.warn_near_timeout(NAME),
        "sink_overviews": coordinator.sink_overviews,
        "open_transactions_in_brief": lambda: coordinator.open_transactions_in_brief(NAME, 50),
        "retire_sink": retire,
        "metrics": lambda: list(DatabaseCollector(engine, ttl_s=0).collect()),
    }
    plans: dict[str, list[str]] = {}
    try:
        for label, call in operations.items():
            seen: list[tuple[str, Any]] = []

            def capture(_conn: object, _cursor: object, statement: str, parameters: Any, *_: object) -> None:
                if "unresolved_leases" in statement:
                    seen.append((statement, parameters))  # noqa: B023 - read before the next iteration

            event.listen(engine, "before_cursor_execute", capture)
            try:
                call()
            finally:
                event.remove(engine, "before_cursor_execute", capture)
            with engine.connect() as conn:
                plans[label] = ["\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + s, p or {}))
                                for s, p in seen]
    finally:
        loop.stop()
    assert all(plans.values()), {k for k, v in plans.items() if not v}  # each asked for unresolved leases
    for label, explained in plans.items():
        for plan in explained:
            assert "Seq Scan on lease_rows" not in plan and "Seq Scan on attempts" not in plan, (label, plan)
            # expired leases are looked up by open attempt: either way is a few rows
            assert "ix_lease_rows_unresolved" in plan or (
                label == "abort_expired_leases" and "uq_lease_rows_attempt_id_partition_task_attempt_id" in plan
            ), (label, plan)
            assert "ix_attempts_open" in plan or label == "abort_expired_leases", (label, plan)
