"""sink retirement: a retired sink keeps its row, name, prefix and event trail, and takes no more calls

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('sinks', sa.Column('retired_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('sinks', 'retired_at')
