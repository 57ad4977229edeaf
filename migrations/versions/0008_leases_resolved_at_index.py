"""HOT lease updates: "unresolved leases" is indexed on `resolved_at IS NULL` instead of `state`.

- leases: `ix_leases_unresolved` was keyed on and filtered by `state`, so every lease state change
  (the decision's LEASED -> COMMITTING among them) wrote new index entries. It is now
  `(sink_id) WHERE resolved_at IS NULL`: a change between unresolved states (LEASED, PRECOMMITTED,
  COMMITTING, ABORTING, LOST_ABORTING) touches no indexed column and can be a HOT update. The
  queries add `resolved_at IS NULL` to their `state IN (...)`.
- The CHECK `ck_leases_resolved` makes `resolved_at IS NULL` the same rows as the unresolved
  states. Rows already resolved without a resolved_at get the best time they have (pre-commit,
  then lease time) first.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 19:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

RESOLVED = "('COMMITTED', 'ABORTED', 'LOST')"
UNRESOLVED = "('LEASED', 'PRECOMMITTED', 'COMMITTING', 'ABORTING', 'LOST_ABORTING')"


def upgrade() -> None:
    op.execute(f'UPDATE leases SET resolved_at = COALESCE(precommitted_at, leased_at) '
               f'WHERE resolved_at IS NULL AND state IN {RESOLVED}')
    # no code path sets it on an unresolved lease; if one did, the state is what recovery acts on
    op.execute(f'UPDATE leases SET resolved_at = NULL WHERE resolved_at IS NOT NULL AND state IN {UNRESOLVED}')
    op.create_check_constraint(op.f('ck_leases_resolved'), 'leases', f"(state IN {RESOLVED}) = (resolved_at IS NOT NULL)")
    op.drop_index('ix_leases_unresolved', table_name='leases')
    op.create_index('ix_leases_unresolved', 'leases', ['sink_id'], postgresql_where=sa.text('resolved_at IS NULL'))


def downgrade() -> None:
    op.drop_index('ix_leases_unresolved', table_name='leases')
    op.create_index('ix_leases_unresolved', 'leases', ['sink_id', 'state'],
                    postgresql_where=sa.text(f'state IN {UNRESOLVED}'))
    op.drop_constraint(op.f('ck_leases_resolved'), 'leases', type_='check')
