"""per-batch figures for operators: the executor's write time on each lease, the driver's write-job
time on each attempt (records and bytes already come with the pre-commit)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 08:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('leases', sa.Column('write_ms', sa.BigInteger(), nullable=True))
    op.add_column('attempts', sa.Column('job_ms', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column('attempts', 'job_ms')
    op.drop_column('leases', 'write_ms')
