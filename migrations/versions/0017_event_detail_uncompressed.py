"""events.detail stored uncompressed (STORAGE EXTERNAL): pglz took ~0.5 ms of a 200-partition decision

The decision's event (`commit_decided`) names its winners by partition and lease id: for 200
partitions ~6.5 KB of jsonb, over the ~2 KB at which Postgres compresses a row's large values. pglz
took ~0.5 ms of Postgres' CPU for each such insert (the jsonb itself ~0.2 ms). Uncompressed, a
decision's detail takes ~6.5 KB on disk instead of ~1.5 KB, beside the ~34 KB of its records, which
are stored uncompressed for the same reason (migration 0015). Smaller details (every other event)
are under the threshold and stored in the row as before.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28 20:10:00
"""

from __future__ import annotations

from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute('ALTER TABLE events ALTER COLUMN detail SET STORAGE EXTERNAL')


def downgrade() -> None:
    op.execute('ALTER TABLE events ALTER COLUMN detail SET STORAGE EXTENDED')
