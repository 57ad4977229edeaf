"""The Alembic migrations create exactly the schema the code declares, and downgrade cleanly."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from coordinator.store.db import downgrade, make_engine, migrate, schema_is_current
from coordinator.store.tables import metadata

TABLES = {"sinks", "generations", "checkpoints", "attempts", "transactional_ids", "lease_rows", "events", "recovery_leader"}


def test_migrated_schema_matches_the_declared_tables(engine):
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)
    assert diffs == []
    assert schema_is_current(engine)


def test_downgrade_to_base_and_upgrade_again(database_url):
    eng = make_engine(database_url, pool_size=1)
    try:
        downgrade(database_url, "base")
        assert TABLES.isdisjoint(inspect(eng).get_table_names())
        assert not schema_is_current(eng)
        migrate(database_url)
        assert TABLES <= set(inspect(eng).get_table_names())
        assert schema_is_current(eng)
    finally:
        eng.dispose()


def test_indexes_for_the_hot_queries_exist(engine):
    insp = inspect(engine)
    names = {ix["name"] for t in TABLES for ix in insp.get_indexes(t)}
    # pool leasing, unresolved-transaction sweeps, open-attempt lookups, audit trail paging
    assert {"uq_transactional_ids_sink_id_ordinal", "ix_lease_rows_unresolved", "ix_attempts_open",
            "ix_events_sink_id_id"} <= names | {c["name"] for c in insp.get_unique_constraints("transactional_ids")}
    # a resolved lease's id is found by its unique transactional_id: no index on lease_id (0007),
    # and none on released_at (0013), so leasing and freeing an id are HOT updates
    pool_columns = {c for ix in insp.get_indexes("transactional_ids") for c in ix["column_names"]}
    assert not pool_columns & {"state", "lease_id", "released_at", "reusable_at"}, insp.get_indexes("transactional_ids")
    # no lease index covers `state`, so moves between unresolved states are HOT updates (0008)
    assert all("state" not in ix["column_names"] and "state" not in str(ix.get("dialect_options", {}))
               for ix in insp.get_indexes("lease_rows")), insp.get_indexes("lease_rows")


def test_tables_updated_per_batch_leave_room_for_hot_updates(engine):
    with engine.connect() as conn:
        options = dict(conn.exec_driver_sql(
            "SELECT relname, reloptions FROM pg_class WHERE relname IN "
            "('checkpoints', 'attempts', 'lease_rows', 'transactional_ids')"
        ).all())
    assert options == {t: ["fillfactor=80"] for t in ("checkpoints", "attempts", "lease_rows", "transactional_ids")}


def test_the_decisions_records_are_stored_as_sent_and_uncompressed(engine):
    """Text as the coordinator encoded it (no jsonb, no json check: migrations 0015, 0018) and no
    compression: written at every decision, read rarely."""
    with engine.connect() as conn:
        stored = conn.exec_driver_sql(
            "SELECT format_type(atttypid, atttypmod), attstorage FROM pg_attribute "
            "WHERE attrelid = 'attempts'::regclass AND attname = 'first_records'"
        ).one()
    assert tuple(stored) == ("text", "e")


def test_event_details_are_stored_uncompressed(engine):
    """A 200-partition decision's detail (~6.5 KB of jsonb) is over the size Postgres compresses at;
    pglz took ~0.5 ms of each such insert (migration 0017)."""
    with engine.connect() as conn:
        storage = conn.exec_driver_sql(
            "SELECT attstorage FROM pg_attribute WHERE attrelid = 'events'::regclass AND attname = 'detail'"
        ).scalar_one()
    assert storage == "e"


def test_state_columns_only_take_their_machine_states(engine):
    insp = inspect(engine)
    for table in ("checkpoints", "attempts", "lease_rows", "transactional_ids"):
        checks = {c["name"] for c in insp.get_check_constraints(table)}
        assert f"ck_{table}_state" in checks


def test_a_lease_must_name_its_attempts_checkpoint_and_sink(engine):
    """One composite foreign key (migration 0010): a lease's checkpoint_id and sink_id are its
    attempt's, checked in one lookup per inserted lease."""
    import pytest
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    with engine.begin() as conn:
        sink = conn.execute(text(
            "INSERT INTO sinks (name, transactional_id_prefix, bootstrap_servers, topics, transaction_timeout_ms, "
            "commit_margin_ms, max_pool_size, created_at) VALUES ('s', 's-', 'k:9092', '[]', 60000, 10000, 4, now()) "
            "RETURNING id")).scalar_one()
        cps = [conn.execute(text(
            "INSERT INTO checkpoints (sink_id, query_id, batch_id, state, created_at) "
            "VALUES (:s, 'q', :b, 'OPEN', now()) RETURNING id"), {"s": sink, "b": b}).scalar_one() for b in (1, 2)]
        attempt = conn.execute(text(
            "INSERT INTO attempts (checkpoint_id, sink_id, number, generation, state, started_at) "
            "VALUES (:c, :s, 1, 0, 'OPEN', now()) RETURNING id"), {"c": cps[0], "s": sink}).scalar_one()
    lease = ("INSERT INTO lease_rows (sink_id, checkpoint_id, attempt_id, partition, task_attempt_id, transactional_id, "
             "state, leased_at, deadline_at) VALUES (:s, :c, :a, 0, :t, 's-0', 'LEASED', now(), now())")
    with engine.begin() as conn:
        conn.execute(text(lease), {"s": sink, "c": cps[0], "a": attempt, "t": 0})
    for task, wrong in enumerate( ({"s": sink, "c": cps[1], "a": attempt}, {"s": sink + 1, "c": cps[0], "a": attempt},
                  {"s": sink, "c": cps[0], "a": attempt + 1}), start=1):
        with pytest.raises(IntegrityError, match="fk_lease_rows_attempt_id_attempts"), engine.begin() as conn:
            conn.execute(text(lease), {**wrong, "t": task})
