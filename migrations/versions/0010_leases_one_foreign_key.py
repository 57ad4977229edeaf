"""leases: one foreign key to their attempt, (attempt_id, checkpoint_id, sink_id), instead of three

A lease's checkpoint_id and sink_id copy its attempt's. Three single-column foreign keys checked
that each exists (three trigger checks per inserted lease) but not that they agree with the
attempt. One composite key to attempts (id, checkpoint_id, sink_id) checks both in one lookup;
attempts' own keys reach checkpoints and sinks.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 00:00:00
"""

from __future__ import annotations

from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute('ALTER TABLE attempts ADD CONSTRAINT uq_attempts_id_checkpoint_id_sink_id '
               'UNIQUE (id, checkpoint_id, sink_id)')
    op.execute('ALTER TABLE leases DROP CONSTRAINT fk_leases_attempt_id_attempts, '
               'DROP CONSTRAINT fk_leases_checkpoint_id_checkpoints, DROP CONSTRAINT fk_leases_sink_id_sinks')
    op.execute('ALTER TABLE leases ADD CONSTRAINT fk_leases_attempt_id_attempts '
               'FOREIGN KEY (attempt_id, checkpoint_id, sink_id) REFERENCES attempts (id, checkpoint_id, sink_id)')


def downgrade() -> None:
    op.execute('ALTER TABLE leases DROP CONSTRAINT fk_leases_attempt_id_attempts')
    op.execute('ALTER TABLE leases '
               'ADD CONSTRAINT fk_leases_attempt_id_attempts FOREIGN KEY (attempt_id) REFERENCES attempts (id), '
               'ADD CONSTRAINT fk_leases_checkpoint_id_checkpoints FOREIGN KEY (checkpoint_id) REFERENCES checkpoints (id), '
               'ADD CONSTRAINT fk_leases_sink_id_sinks FOREIGN KEY (sink_id) REFERENCES sinks (id)')
    op.execute('ALTER TABLE attempts DROP CONSTRAINT uq_attempts_id_checkpoint_id_sink_id')
