"""the decision's records on the attempt row as text: the coordinator wrote the JSON, Postgres
checked it again on every decision

`attempts.first_records` (migrations 0012, 0015) is only ever written by the decision of first
tries, from JSON the coordinator encoded itself (`hot_path._json`). As json, Postgres parsed the
whole document to check it at every write: for 200 partitions with 8 first offsets each (~42 KB),
inserting it took ~0.71-0.84 ms of Postgres' CPU, against ~0.27-0.35 ms for the same text (STORAGE
EXTERNAL, as before). Reads (an operator's, the recovery loop's, a retry's lease, the general mark)
go through the views or cast it to json first: that check moves to them (~0.45 ms for such a
document), on paths the common one does not take.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 20:25:00
"""

from __future__ import annotations

import importlib

from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

_0015 = importlib.import_module('migrations.versions.0015_first_records_as_json')

FIRST_TRY_LEASES_TEXT = _0015.FIRST_TRY_LEASES_JSON.replace(
    'json_array_elements(a.first_records)', 'json_array_elements(CAST(a.first_records AS json))')


def upgrade() -> None:
    assert FIRST_TRY_LEASES_TEXT.count('CAST(a.first_records AS json)') == 1
    _0015._drop_views()
    # a new type takes its default storage: uncompressed again, as migration 0015 set it
    op.execute('ALTER TABLE attempts ALTER COLUMN first_records TYPE text, '
               'ALTER COLUMN first_records SET STORAGE EXTERNAL')
    _0015._views(FIRST_TRY_LEASES_TEXT)


def downgrade() -> None:
    _0015._drop_views()
    op.execute('ALTER TABLE attempts ALTER COLUMN first_records TYPE json USING CAST(first_records AS json), '
               'ALTER COLUMN first_records SET STORAGE EXTERNAL')
    _0015._views(_0015.FIRST_TRY_LEASES_JSON)
