"""sink retirement: a retired sink keeps its row, name, prefix and event trail, and takes no more calls

Revision ID: 0005
Revises: 0003
Create Date: 2026-11-23 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0003'  # at merge: the newest revision on main (0004 when the two-call protocol lands)
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('sinks', sa.Column('retired_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('sinks', 'retired_at')
