"""two calls per batch (DESIGN §3 Revisions): the offsets digest bound to a checkpoint, the first
offsets a winner wrote (reported with the commit), and the id pool's least-recently-used order
and quarantine

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 13:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('checkpoints', sa.Column('offsets_digest', sa.String(128), nullable=True))
    op.add_column('leases', sa.Column('first_offsets', postgresql.JSONB(), nullable=True))
    op.add_column('transactional_ids', sa.Column('released_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('transactional_ids', sa.Column('reusable_at', sa.DateTime(timezone=True), nullable=True))
    op.drop_index('ix_transactional_ids_free', table_name='transactional_ids')
    op.create_index('ix_transactional_ids_free_lru', 'transactional_ids', ['sink_id', 'released_at', 'ordinal'],
                    postgresql_where=sa.text("state = 'FREE'"))


def downgrade() -> None:
    op.drop_index('ix_transactional_ids_free_lru', table_name='transactional_ids')
    op.create_index('ix_transactional_ids_free', 'transactional_ids', ['sink_id', 'ordinal'],
                    postgresql_where=sa.text("state = 'FREE'"))
    op.drop_column('transactional_ids', 'reusable_at')
    op.drop_column('transactional_ids', 'released_at')
    op.drop_column('leases', 'first_offsets')
    op.drop_column('checkpoints', 'offsets_digest')
