"""coordinator_assert(ok, message): a statement's own check of its results, raised as an error

A hot-path statement may carry its transaction's COMMIT in the same round trip (driver_sql), so
a check in Python after it would see its results only once they are committed. Such a statement
checks them itself: `coordinator_assert(false, ...)` raises, the COMMIT after it does not run, and
the transaction rolls back. The error is SQLSTATE XX000 (internal_error): like the AssertionError
it stands for, it means the coordinator's own rules and the database disagree.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 13:40:00
"""

from __future__ import annotations

from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
CREATE FUNCTION coordinator_assert(ok boolean, message text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF ok IS NOT TRUE THEN
        RAISE EXCEPTION USING ERRCODE = 'XX000', MESSAGE = 'coordinator_assert: ' || message;
    END IF;
    RETURN true;
END
$$
""")


def downgrade() -> None:
    op.execute("DROP FUNCTION coordinator_assert(boolean, text)")
