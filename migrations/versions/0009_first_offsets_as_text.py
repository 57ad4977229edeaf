"""leases.first_offsets stored as JSON text, not jsonb

A winner's first offsets ([topic, partition, offset] per topic-partition its transaction wrote) are
read only when Kafka refuses its commit (to look in the log). As jsonb, every read of a lease row
parsed them: at 200 partitions writing 8 topic-partitions each, ~5 ms of the coordinator's CPU per
read of a checkpoint's leases. As text they are stored as written (the decision's statement still
checks them as JSON) and parsed on the refusal path only. The type change rewrites the table.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 00:00:00
"""

from __future__ import annotations

from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute('ALTER TABLE leases ALTER COLUMN first_offsets TYPE text USING first_offsets::text')


def downgrade() -> None:
    op.execute('ALTER TABLE leases ALTER COLUMN first_offsets TYPE jsonb USING first_offsets::jsonb')
