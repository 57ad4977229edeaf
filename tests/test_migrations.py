"""The Alembic migrations create exactly the schema the code declares, and downgrade cleanly."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from coordinator.store.db import downgrade, make_engine, migrate, schema_is_current
from coordinator.store.tables import metadata

TABLES = {"sinks", "generations", "checkpoints", "attempts", "transactional_ids", "leases", "events", "recovery_leader"}


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
    assert {"ix_transactional_ids_free_lru", "ix_leases_unresolved", "ix_attempts_open", "ix_events_sink_id_id"} <= names
    # a resolved lease's id is found by its unique transactional_id: no index on lease_id (0007),
    # so leasing an id is a HOT update
    assert "ix_transactional_ids_lease_id" not in names
    # no lease index covers `state`, so moves between unresolved states are HOT updates (0008)
    assert all("state" not in ix["column_names"] and "state" not in str(ix.get("dialect_options", {}))
               for ix in insp.get_indexes("leases")), insp.get_indexes("leases")


def test_tables_updated_per_batch_leave_room_for_hot_updates(engine):
    with engine.connect() as conn:
        options = dict(conn.exec_driver_sql(
            "SELECT relname, reloptions FROM pg_class WHERE relname IN "
            "('checkpoints', 'attempts', 'leases', 'transactional_ids')"
        ).all())
    assert options == {t: ["fillfactor=80"] for t in ("checkpoints", "attempts", "leases", "transactional_ids")}


def test_state_columns_only_take_their_machine_states(engine):
    insp = inspect(engine)
    for table in ("checkpoints", "attempts", "leases", "transactional_ids"):
        checks = {c["name"] for c in insp.get_check_constraints(table)}
        assert f"ck_{table}_state" in checks
