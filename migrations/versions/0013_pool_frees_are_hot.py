"""transactional_ids: no index on released_at, so freeing an id is a HOT update

Every batch frees the ids it leased (the committed mark, or the decision for an empty partition)
and that sets `released_at`, the second key of `ix_transactional_ids_free_lru`. So each free wrote
a new row version with an entry in all four of the table's indexes: a 200-partition batch's mark
touched ~3,700 buffers for its 200 ids. Without that index no index covers a column a free or a
lease changes, and both are heap-only updates.

The pool still hands out the least recently released free id first: the pool query reads the
sink's ids through `uq_transactional_ids_sink_id_ordinal` and sorts them. A sink's pool is about
its partition count (plus retried tries' ids, and ids in quarantine), so that is a few hundred
rows where the index walk read as many.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 09:30:00
"""

from __future__ import annotations

from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index('ix_transactional_ids_free_lru', table_name='transactional_ids')


def downgrade() -> None:
    op.create_index('ix_transactional_ids_free_lru', 'transactional_ids', ['sink_id', 'released_at', 'ordinal'])
