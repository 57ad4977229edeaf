"""lost data (LOST states, sink halt, checkpoint lost reason) and the recovery loop's leader row

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

_OLD_UNRESOLVED = "state IN ('LEASED', 'PRECOMMITTED', 'COMMITTING', 'ABORTING')"
_NEW_UNRESOLVED = "state IN ('LEASED', 'PRECOMMITTED', 'COMMITTING', 'ABORTING', 'LOST_ABORTING')"


def _states(table: str, *names: str) -> None:
    op.drop_constraint(op.f(f'ck_{table}_state'), table, type_='check')
    op.create_check_constraint(op.f(f'ck_{table}_state'), table, "state IN (" + ", ".join(f"'{n}'" for n in names) + ")")


def _unresolved_index(where: str) -> None:
    op.drop_index('ix_leases_unresolved', table_name='leases')
    op.create_index('ix_leases_unresolved', 'leases', ['sink_id', 'state'], unique=False, postgresql_where=sa.text(where))


def upgrade() -> None:
    op.add_column('sinks', sa.Column('halted_reason', sa.String(length=2000), nullable=True))
    op.add_column('sinks', sa.Column('halted_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('checkpoints', sa.Column('lost_reason', sa.String(length=2000), nullable=True))
    op.add_column('checkpoints', sa.Column('lost_at', sa.DateTime(timezone=True), nullable=True))
    _states('checkpoints', 'OPEN', 'COMMITTING', 'COMMITTED', 'LOST')
    _states('attempts', 'OPEN', 'COMMITTING', 'COMMITTED', 'ABORTED', 'LOST')
    _states('leases', 'LEASED', 'PRECOMMITTED', 'COMMITTING', 'COMMITTED', 'ABORTING', 'ABORTED', 'LOST_ABORTING', 'LOST')
    _unresolved_index(_NEW_UNRESOLVED)
    leader = op.create_table('recovery_leader',
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('holder', sa.String(length=200), nullable=True),
    sa.Column('token', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('acquired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_recovery_leader'))
    )
    # held by nobody, long expired: the first replica's UPDATE takes it
    op.execute(leader.insert().values(name='recovery', holder=None, token=0,
                                      expires_at=sa.text("TIMESTAMPTZ '1970-01-01 00:00:00+00'")))


def downgrade() -> None:
    # LOST rows cannot be expressed in the old schema: a downgrade with lost data is refused
    bind = op.get_bind()
    lost = bind.execute(sa.text(
        "SELECT (SELECT count(*) FROM checkpoints WHERE state = 'LOST')"
        " + (SELECT count(*) FROM attempts WHERE state = 'LOST')"
        " + (SELECT count(*) FROM leases WHERE state IN ('LOST', 'LOST_ABORTING'))"
    )).scalar()
    if lost:
        raise RuntimeError(f"{lost} rows are in a LOST state; resolve them before downgrading below 0002")
    op.drop_table('recovery_leader')
    _unresolved_index(_OLD_UNRESOLVED)
    _states('leases', 'LEASED', 'PRECOMMITTED', 'COMMITTING', 'COMMITTED', 'ABORTING', 'ABORTED')
    _states('attempts', 'OPEN', 'COMMITTING', 'COMMITTED', 'ABORTED')
    _states('checkpoints', 'OPEN', 'COMMITTING', 'COMMITTED')
    op.drop_column('checkpoints', 'lost_at')
    op.drop_column('checkpoints', 'lost_reason')
    op.drop_column('sinks', 'halted_at')
    op.drop_column('sinks', 'halted_reason')
