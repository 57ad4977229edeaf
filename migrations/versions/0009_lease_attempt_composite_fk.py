"""One foreign key per lease row instead of three: (attempt_id, checkpoint_id, sink_id) -> attempts.

A lease keeps its checkpoint's and sink's ids beside its attempt's (for its indexes). Each of the
three had a foreign key of its own, so inserting a lease ran three referential checks, each
locking its parent row (FOR KEY SHARE): 600 for a 200-partition begin, about half of Postgres'
CPU for that batch. One composite key to the attempt checks as much and more (the copied ids must
be the attempt's own: the attempt's keys to its checkpoint and sink do the rest) in one check.
It needs `attempts (id, checkpoint_id, sink_id)` unique, which `id` alone already is.

Upgrading fails if a lease's checkpoint or sink id is not its attempt's (the coordinator never
writes such a row).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 22:00:00
"""

from __future__ import annotations

from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_unique_constraint(op.f('uq_attempts_id_checkpoint_id_sink_id'), 'attempts', ['id', 'checkpoint_id', 'sink_id'])
    op.drop_constraint(op.f('fk_leases_attempt_id_attempts'), 'leases', type_='foreignkey')
    op.drop_constraint(op.f('fk_leases_checkpoint_id_checkpoints'), 'leases', type_='foreignkey')
    op.drop_constraint(op.f('fk_leases_sink_id_sinks'), 'leases', type_='foreignkey')
    op.create_foreign_key(op.f('fk_leases_attempt_id_attempts'), 'leases', 'attempts',
                          ['attempt_id', 'checkpoint_id', 'sink_id'], ['id', 'checkpoint_id', 'sink_id'])


def downgrade() -> None:
    op.drop_constraint(op.f('fk_leases_attempt_id_attempts'), 'leases', type_='foreignkey')
    op.create_foreign_key(op.f('fk_leases_sink_id_sinks'), 'leases', 'sinks', ['sink_id'], ['id'])
    op.create_foreign_key(op.f('fk_leases_checkpoint_id_checkpoints'), 'leases', 'checkpoints', ['checkpoint_id'], ['id'])
    op.create_foreign_key(op.f('fk_leases_attempt_id_attempts'), 'leases', 'attempts', ['attempt_id'], ['id'])
    op.drop_constraint(op.f('uq_attempts_id_checkpoint_id_sink_id'), 'attempts', type_='unique')
