"""HOT-friendly pool and attempts: updates that only move a row's state can be heap-only (no new
index entries) when no index covers the columns they change.

- transactional_ids: the free-id LRU index no longer has `state = 'FREE'` as its predicate (the
  pool query filters on state while walking it in LRU order; a sink's LEASED ids are few), and
  the lease_id index is gone (a resolved lease's id is found by its unique transactional_id), so
  leasing an id (state, lease_id) is a HOT update.
- attempts: "open attempts of a sink" is indexed on `finished_at IS NULL` (OPEN or COMMITTING;
  every end state sets finished_at) instead of `state = 'OPEN'`, so the decision (OPEN ->
  COMMITTING) is a HOT update; the queries add `finished_at IS NULL` to their `state = 'OPEN'`.
- fillfactor 80 on the four tables updated per batch, so a page keeps room for new row versions.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 17:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

HOT_TABLES = ('checkpoints', 'attempts', 'leases', 'transactional_ids')


def upgrade() -> None:
    op.drop_index('ix_transactional_ids_lease_id', table_name='transactional_ids')
    op.drop_index('ix_transactional_ids_free_lru', table_name='transactional_ids')
    op.create_index('ix_transactional_ids_free_lru', 'transactional_ids', ['sink_id', 'released_at', 'ordinal'])
    op.drop_index('ix_attempts_open', table_name='attempts')
    op.create_index('ix_attempts_open', 'attempts', ['sink_id'], postgresql_where=sa.text('finished_at IS NULL'))
    for table in HOT_TABLES:
        op.execute(f'ALTER TABLE {table} SET (fillfactor = 80)')


def downgrade() -> None:
    for table in HOT_TABLES:
        op.execute(f'ALTER TABLE {table} RESET (fillfactor)')
    op.drop_index('ix_attempts_open', table_name='attempts')
    op.create_index('ix_attempts_open', 'attempts', ['sink_id'], postgresql_where=sa.text("state = 'OPEN'"))
    op.drop_index('ix_transactional_ids_free_lru', table_name='transactional_ids')
    op.create_index('ix_transactional_ids_free_lru', 'transactional_ids', ['sink_id', 'released_at', 'ordinal'],
                    postgresql_where=sa.text("state = 'FREE'"))
    op.create_index('ix_transactional_ids_lease_id', 'transactional_ids', ['lease_id'],
                    postgresql_where=sa.text('lease_id IS NOT NULL'))
