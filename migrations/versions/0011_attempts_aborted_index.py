"""attempts: a partial index on the sink's aborted attempts

A generation start answers with the leases of the attempts it fenced (`abort_reason` names the
generation), found through the sink's aborted attempts. No index covered them, so each start (a
query's every restart) scanned every attempt of every sink. Aborted attempts are few, and the
index has no entry for the others: the decision and the committed mark, which never set
`abort_reason`, stay HOT updates.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 00:00:00
"""

from __future__ import annotations

from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute('CREATE INDEX ix_attempts_aborted ON attempts (sink_id) WHERE abort_reason IS NOT NULL')


def downgrade() -> None:
    op.execute('DROP INDEX ix_attempts_aborted')
