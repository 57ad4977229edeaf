"""One baseline migration for the unreleased schema (issue 48 §5): upgrading from it gives exactly
the schema the models declare (coordinator/store/tables.py) -- columns, indexes with their
predicates, check constraints -- and it downgrades to an empty database and back."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect

from coordinator.store.db import alembic_config, downgrade, make_engine, migrate, schema_is_current
from coordinator.store.tables import metadata
from fixtures.schema_catalog import catalog, empty_database_url  # noqa: F401 - a fixture

TABLES = {"sinks", "id_pools", "quarantined_ids", "generations", "checkpoints", "attempts", "leases", "events",
          "recovery_leader"}


def test_there_is_one_baseline_migration(database_url: str) -> None:
    scripts = ScriptDirectory.from_config(alembic_config(database_url))
    (only,) = list(scripts.walk_revisions())
    assert only.revision == "0001" and only.down_revision is None
    assert scripts.get_current_head() == "0001"


def test_the_models_declare_exactly_the_tables_of_the_rebuild() -> None:
    assert set(metadata.tables) == TABLES


def test_migrated_schema_matches_the_declared_tables(engine: Engine) -> None:
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)
    assert diffs == []
    with engine.connect() as conn:
        assert schema_is_current(conn)


def test_the_migrated_schema_is_the_models_schema_index_for_index_and_check_for_check(
        engine: Engine, empty_database_url: str) -> None:
    """Alembic's comparison skips index predicates and check constraints: here Postgres states
    both schemas, the migrated one and one created from the models, and they must be the same."""
    from_models = make_engine(empty_database_url, pool_size=1)
    try:
        metadata.create_all(from_models)
        with from_models.connect() as conn:
            declared = catalog(conn)
    finally:
        from_models.dispose()
    with engine.connect() as conn:
        migrated = catalog(conn)
    assert migrated.tables() == TABLES
    assert sorted(migrated.columns ^ declared.columns) == []
    assert sorted(migrated.indexes ^ declared.indexes) == []
    assert sorted(migrated.constraints ^ declared.constraints) == []
    # the rules the database holds itself are among them
    assert migrated.index("uq_leases_held") == (
        "CREATE UNIQUE INDEX uq_leases_held ON public.leases USING btree (sink_id, ordinal) WHERE (resolved_at IS NULL)")
    resolved = migrated.constraint("ck_leases_resolved")
    assert "resolved_at IS NULL" in resolved and "'PRELEASED'" in resolved and "'COMMITTED'" not in resolved
    for table in ("checkpoints", "attempts", "leases"):
        assert migrated.constraint(f"ck_{table}_state").startswith("CHECK (((state)::text = ANY")
    assert "NULLS NOT DISTINCT" in migrated.constraint("uq_leases_attempt_id_partition_task_attempt_id")


def test_the_schema_comparison_sees_a_lost_predicate_and_a_lost_check(engine: Engine) -> None:
    """The comparison above can fail: an index without its WHERE, or a check constraint gone, is a
    different catalog (changed inside a transaction that is rolled back)."""
    with engine.connect() as conn, conn.begin() as tx:
        before = catalog(conn)
        conn.exec_driver_sql("DROP INDEX uq_leases_held")
        conn.exec_driver_sql("CREATE UNIQUE INDEX uq_leases_held ON leases (sink_id, ordinal)")
        conn.exec_driver_sql("ALTER TABLE leases DROP CONSTRAINT ck_leases_resolved")
        after = catalog(conn)
        tx.rollback()
    assert {name for _, name, _ in before.indexes ^ after.indexes} == {"uq_leases_held"}
    assert {name for _, name, _, _ in before.constraints ^ after.constraints} == {"ck_leases_resolved"}
    assert before.columns == after.columns


def test_indexes_for_the_hot_queries_exist(engine: Engine) -> None:
    insp = inspect(engine)
    names = {ix["name"] for t in TABLES for ix in insp.get_indexes(t)}
    # the pool and every read of possibly open transactions, open attempts, decided commits, pruning,
    # a checkpoint's leases, the audit trail's pages
    assert {"uq_leases_held", "ix_attempts_open", "ix_attempts_aborted", "ix_checkpoints_decided",
            "ix_checkpoints_prunable", "ix_leases_checkpoint_id", "ix_events_sink_id_id"} <= names


def test_downgrade_to_base_and_upgrade_again(database_url: str) -> None:
    eng = make_engine(database_url, pool_size=1)
    try:
        with eng.connect() as conn:
            before = catalog(conn)
        downgrade(database_url, "base")
        assert set(inspect(eng).get_table_names()) <= {"alembic_version"}
        with eng.connect() as conn:
            assert not schema_is_current(conn)
        migrate(database_url)
        with eng.connect() as conn:
            assert schema_is_current(conn)
        with eng.connect() as conn:
            assert catalog(conn) == before
    finally:
        eng.dispose()
