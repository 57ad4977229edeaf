"""transactional_ids: the planner is told a sink has a few ids, so the pool query's generic plan
reads the sink's ids by index

The pool query (`repo._FREE_IDS`) runs its generic plan (driver_sql's `generic_plan`): planned once
per session for any sink, so its row estimate for `sink_id = $1` is the table's rows divided by
the number of distinct sinks. Where one sink holds most of the ids (a large pool beside small
ones), that estimate is most of the table and the plan scanned all of it and sorted it: ~4 ms per
begin with 40,000 ids, against ~0.04 ms through `uq_transactional_ids_sink_id_ordinal`.

`n_distinct = -0.05` says the table has a distinct sink per 20 ids, whatever ANALYZE samples. A
sink's pool is about its partition count (plus retried tries' ids and ids in quarantine), so the
index is the right path for every sink, even the largest: its rows are read in index order and
sorted either way. Plans for a named sink (an operator's reads) still use the sampled most common
values.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27 20:10:00
"""

from __future__ import annotations

from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE transactional_ids ALTER COLUMN sink_id SET (n_distinct = -0.05)")
    op.execute("ANALYZE transactional_ids")  # the setting counts from the next ANALYZE


def downgrade() -> None:
    op.execute("ALTER TABLE transactional_ids ALTER COLUMN sink_id RESET (n_distinct)")
    op.execute("ANALYZE transactional_ids")
