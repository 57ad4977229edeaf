"""The baseline schema: every table of coordinator/store/tables.py, as first released.

Revision ID: 0001
Revises:
Create Date: 2026-12-06

Later changes to the schema are migrations of their own after this one
(tests/store/test_migrations.py checks that upgrading gives exactly the models' schema).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('recovery_leader',
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('holder', sa.String(length=200), nullable=True),
    sa.Column('token', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('acquired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_recovery_leader'))
    )
    op.create_table('sinks',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('transactional_id_prefix', sa.String(length=200), nullable=False),
    sa.Column('bootstrap_servers', sa.String(length=2000), nullable=False),
    sa.Column('topics', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('transaction_timeout_ms', sa.Integer(), nullable=False),
    sa.Column('commit_margin_ms', sa.Integer(), nullable=False),
    sa.Column('max_pool_size', sa.Integer(), nullable=False),
    sa.Column('generation', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('lineage_query_id', sa.String(length=100), nullable=True),
    sa.Column('writer_token_version', sa.Integer(), server_default=sa.text('1'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('halted_reason', sa.String(length=2000), nullable=True),
    sa.Column('halted_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('retired_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sinks')),
    sa.UniqueConstraint('name', name=op.f('uq_sinks_name')),
    sa.UniqueConstraint('transactional_id_prefix', name=op.f('uq_sinks_transactional_id_prefix'))
    )
    op.create_table('checkpoints',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('sink_id', sa.BigInteger(), nullable=False),
    sa.Column('query_id', sa.String(length=100), nullable=False),
    sa.Column('batch_id', sa.BigInteger(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('current_attempt', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('committed_attempt', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('decided_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('committed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('lost_reason', sa.String(length=2000), nullable=True),
    sa.Column('lost_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('offsets_digest', sa.String(length=128), nullable=True),
    sa.Column('history_pruned_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("history_pruned_at IS NULL OR state = 'COMMITTED'", name=op.f('ck_checkpoints_pruned_committed')),
    sa.CheckConstraint("state IN ('COMMITTED', 'COMMITTING', 'LOST', 'OPEN')", name=op.f('ck_checkpoints_state')),
    sa.ForeignKeyConstraint(['sink_id'], ['sinks.id'], name=op.f('fk_checkpoints_sink_id_sinks')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('sink_id', 'query_id', 'batch_id', name=op.f('uq_checkpoints_sink_id_query_id_batch_id'))
    )
    op.create_index('ix_checkpoints_decided', 'checkpoints', ['sink_id'], unique=False, postgresql_where=sa.text("state IN ('COMMITTING', 'LOST')"))
    op.create_index('ix_checkpoints_prunable', 'checkpoints', ['committed_at'], unique=False, postgresql_where=sa.text("state = 'COMMITTED' AND history_pruned_at IS NULL"))
    op.create_index(op.f('ix_checkpoints_sink_id_batch_id'), 'checkpoints', ['sink_id', 'batch_id'], unique=False)
    op.create_table('generations',
    sa.Column('sink_id', sa.BigInteger(), nullable=False),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.Column('query_id', sa.String(length=100), nullable=False),
    sa.Column('run_id', sa.String(length=100), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['sink_id'], ['sinks.id'], name=op.f('fk_generations_sink_id_sinks')),
    sa.PrimaryKeyConstraint('sink_id', 'generation', name=op.f('pk_generations')),
    sa.UniqueConstraint('sink_id', 'run_id', name=op.f('uq_generations_sink_id_run_id'))
    )
    op.create_table('id_pools',
    sa.Column('sink_id', sa.BigInteger(), nullable=False),
    sa.Column('size', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('cursor', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.ForeignKeyConstraint(['sink_id'], ['sinks.id'], name=op.f('fk_id_pools_sink_id_sinks')),
    sa.PrimaryKeyConstraint('sink_id', name=op.f('pk_id_pools'))
    )
    op.create_table('quarantined_ids',
    sa.Column('sink_id', sa.BigInteger(), nullable=False),
    sa.Column('ordinal', sa.Integer(), nullable=False),
    sa.Column('until', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['sink_id'], ['sinks.id'], name=op.f('fk_quarantined_ids_sink_id_sinks')),
    sa.PrimaryKeyConstraint('sink_id', 'ordinal', name=op.f('pk_quarantined_ids'))
    )
    op.create_table('attempts',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('checkpoint_id', sa.BigInteger(), nullable=False),
    sa.Column('sink_id', sa.BigInteger(), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('partitions', sa.Integer(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('decided_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('abort_reason', sa.String(length=200), nullable=True),
    sa.Column('job_ms', sa.BigInteger(), nullable=True),
    sa.CheckConstraint("state IN ('ABORTED', 'COMMITTED', 'COMMITTING', 'LOST', 'OPEN')", name=op.f('ck_attempts_state')),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_attempts_checkpoint_id_checkpoints')),
    sa.ForeignKeyConstraint(['sink_id'], ['sinks.id'], name=op.f('fk_attempts_sink_id_sinks')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_attempts')),
    sa.UniqueConstraint('checkpoint_id', 'number', name=op.f('uq_attempts_checkpoint_id_number')),
    sa.UniqueConstraint('id', 'checkpoint_id', 'sink_id', name=op.f('uq_attempts_id_checkpoint_id_sink_id'))
    )
    op.create_index('ix_attempts_aborted', 'attempts', ['sink_id'], unique=False, postgresql_where=sa.text('abort_reason IS NOT NULL'))
    op.create_index('ix_attempts_open', 'attempts', ['sink_id'], unique=False, postgresql_where=sa.text("state = 'OPEN'"))
    op.create_table('events',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('sink_id', sa.BigInteger(), nullable=False),
    sa.Column('checkpoint_id', sa.BigInteger(), nullable=True),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('actor', sa.String(length=200), nullable=False),
    sa.Column('detail', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_events_checkpoint_id_checkpoints')),
    sa.ForeignKeyConstraint(['sink_id'], ['sinks.id'], name=op.f('fk_events_sink_id_sinks')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    op.create_index(op.f('ix_events_checkpoint_id'), 'events', ['checkpoint_id'], unique=False, postgresql_where=sa.text('checkpoint_id IS NOT NULL'))
    op.create_index(op.f('ix_events_sink_id_id'), 'events', ['sink_id', 'id'], unique=False)
    op.create_table('leases',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('sink_id', sa.BigInteger(), nullable=False),
    sa.Column('checkpoint_id', sa.BigInteger(), nullable=False),
    sa.Column('attempt_id', sa.BigInteger(), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('task_attempt_id', sa.BigInteger(), nullable=True),
    sa.Column('ordinal', sa.Integer(), nullable=False),
    sa.Column('transactional_id', sa.String(length=255), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('taken_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('leased_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('producer_id', sa.BigInteger(), nullable=True),
    sa.Column('producer_epoch', sa.Integer(), nullable=True),
    sa.Column('records', sa.BigInteger(), nullable=True),
    sa.Column('bytes', sa.BigInteger(), nullable=True),
    sa.Column('write_ms', sa.BigInteger(), nullable=True),
    sa.Column('first_offsets', sa.Text(), nullable=True),
    sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("(state IN ('ABORTING', 'COMMITTING', 'LEASED', 'LOST_ABORTING', 'PRELEASED')) = (resolved_at IS NULL)", name=op.f('ck_leases_resolved')),
    sa.CheckConstraint("state IN ('ABORTED', 'ABORTING', 'COMMITTED', 'COMMITTING', 'LEASED', 'LOST', 'LOST_ABORTING', 'PRELEASED')", name=op.f('ck_leases_state')),
    sa.ForeignKeyConstraint(['attempt_id', 'checkpoint_id', 'sink_id'], ['attempts.id', 'attempts.checkpoint_id', 'attempts.sink_id'], name=op.f('fk_leases_attempt_id_attempts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_leases')),
    sa.UniqueConstraint('attempt_id', 'partition', 'task_attempt_id', name=op.f('uq_leases_attempt_id_partition_task_attempt_id'), postgresql_nulls_not_distinct=True)
    )
    op.create_index(op.f('ix_leases_checkpoint_id'), 'leases', ['checkpoint_id'], unique=False)
    op.create_index('uq_leases_held', 'leases', ['sink_id', 'ordinal'], unique=True, postgresql_where=sa.text('resolved_at IS NULL'))


def downgrade() -> None:
    op.drop_index('uq_leases_held', table_name='leases', postgresql_where=sa.text('resolved_at IS NULL'))
    op.drop_index(op.f('ix_leases_checkpoint_id'), table_name='leases')
    op.drop_table('leases')
    op.drop_index(op.f('ix_events_sink_id_id'), table_name='events')
    op.drop_index(op.f('ix_events_checkpoint_id'), table_name='events', postgresql_where=sa.text('checkpoint_id IS NOT NULL'))
    op.drop_table('events')
    op.drop_index('ix_attempts_open', table_name='attempts', postgresql_where=sa.text("state = 'OPEN'"))
    op.drop_index('ix_attempts_aborted', table_name='attempts', postgresql_where=sa.text('abort_reason IS NOT NULL'))
    op.drop_table('attempts')
    op.drop_table('quarantined_ids')
    op.drop_table('id_pools')
    op.drop_table('generations')
    op.drop_index(op.f('ix_checkpoints_sink_id_batch_id'), table_name='checkpoints')
    op.drop_index('ix_checkpoints_prunable', table_name='checkpoints', postgresql_where=sa.text("state = 'COMMITTED' AND history_pruned_at IS NULL"))
    op.drop_index('ix_checkpoints_decided', table_name='checkpoints', postgresql_where=sa.text("state IN ('COMMITTING', 'LOST')"))
    op.drop_table('checkpoints')
    op.drop_table('sinks')
    op.drop_table('recovery_leader')
