"""checkpoints.history_pruned_at: when an old committed batch's history was pruned

`coordinator prune-history` (and the retention setting) deletes the bulky history of committed
batches older than the retention: their attempts (with the first tries' ids and pre-commit
records), their lease rows and their events. The checkpoint row itself stays, marked with the
time of the pruning: it is what answers a replay of the batch id (skipped as committed) and what
refuses a re-plan of it over other offsets (its offsets digest), so pruning never changes what a
begin decides. A pruned checkpoint is always COMMITTED and has no attempt, lease or event.

`ix_checkpoints_prunable` (commit time, of the COMMITTED checkpoints not pruned yet) lets each
pruning call find the oldest batches without reading the rows already pruned, which stay.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28 22:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('checkpoints', sa.Column('history_pruned_at', sa.TIMESTAMP(timezone=True), nullable=True))
    op.create_check_constraint(op.f('ck_checkpoints_pruned_committed'), 'checkpoints',
                               "history_pruned_at IS NULL OR state = 'COMMITTED'")
    op.create_index('ix_checkpoints_prunable', 'checkpoints', ['committed_at'],
                    postgresql_where=sa.text("state = 'COMMITTED' AND history_pruned_at IS NULL"))


def downgrade() -> None:
    op.drop_index('ix_checkpoints_prunable', table_name='checkpoints')
    op.drop_constraint(op.f('ck_checkpoints_pruned_committed'), 'checkpoints', type_='check')
    op.drop_column('checkpoints', 'history_pruned_at')
