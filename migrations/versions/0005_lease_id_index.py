"""an index on transactional_ids.lease_id: every commit and abort frees its ids with
`UPDATE transactional_ids ... WHERE lease_id IN (...)`, which scanned the whole pool table (all
sinks) without one. Partial: only LEASED ids have a lease_id.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 13:55:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_transactional_ids_lease_id', 'transactional_ids', ['lease_id'],
                    postgresql_where=sa.text('lease_id IS NOT NULL'))


def downgrade() -> None:
    op.drop_index('ix_transactional_ids_lease_id', table_name='transactional_ids')
