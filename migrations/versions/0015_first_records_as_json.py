"""the decision's records on the attempt row as json, not jsonb: stored as sent, read rarely

`attempts.first_records` holds a batch's pre-commit records by partition (migration 0012): written
once, by the decision, and read only when something reads the batch's leases (an operator, the
recovery loop, a retry's lease, the committed mark's answer). jsonb parsed the decision's whole
document into its binary form on every write: for 200 partitions with 8 first offsets each
(~33 KB) ~1.3 ms of Postgres' CPU per batch, against ~0.4 ms for json, which only checks the
text and stores it as sent. Each read of the records now parses them instead; the common path
reads them in the committed mark (its guard and answer, through `leases`). They are stored
uncompressed (STORAGE EXTERNAL): pglz took ~0.25 ms of each such write, and reading them back
costs the same either way.

A record's first offsets read through the views are now the text the coordinator sent (compact
JSON), not jsonb's rendering of it; both are the same JSON value, and a lease row keeps the text
it was copied with. The views are recreated over json (json_array_elements; json has no equality,
so a null record is found by json_typeof).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 17:20:00
"""

from __future__ import annotations

import importlib

from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

_0012 = importlib.import_module('migrations.versions.0012_first_tries_on_the_attempt')
LEASE_COLUMNS = _0012.LEASE_COLUMNS

FIRST_TRY_LEASES_JSON = (
    _0012.FIRST_TRY_LEASES
    .replace('jsonb_array_elements(a.first_records)', 'json_array_elements(a.first_records)')
    .replace("(SELECT NULLIF(f.rec, 'null') AS rec)",
             "(SELECT CASE WHEN json_typeof(f.rec) <> 'null' THEN f.rec END AS rec)")
)


def _views(first_try_leases: str) -> None:
    op.execute(first_try_leases)
    op.execute(f'CREATE VIEW leases AS SELECT {LEASE_COLUMNS} FROM lease_rows '
               f'UNION ALL SELECT {LEASE_COLUMNS} FROM first_try_leases')
    op.execute(f'CREATE VIEW unresolved_leases AS SELECT {LEASE_COLUMNS} FROM lease_rows WHERE resolved_at IS NULL '
               f'UNION ALL SELECT {LEASE_COLUMNS} FROM first_try_leases '
               'WHERE attempt_finished_at IS NULL AND resolved_at IS NULL')


def _drop_views() -> None:
    op.execute('DROP VIEW unresolved_leases')
    op.execute('DROP VIEW leases')
    op.execute('DROP VIEW first_try_leases')


def upgrade() -> None:
    assert FIRST_TRY_LEASES_JSON.count('json_array_elements') == 1 and 'json_typeof' in FIRST_TRY_LEASES_JSON
    _drop_views()
    op.execute('ALTER TABLE attempts ALTER COLUMN first_records TYPE json USING CAST(first_records AS json)')
    op.execute('ALTER TABLE attempts ALTER COLUMN first_records SET STORAGE EXTERNAL')
    _views(FIRST_TRY_LEASES_JSON)


def downgrade() -> None:
    _drop_views()
    op.execute('ALTER TABLE attempts ALTER COLUMN first_records SET STORAGE EXTENDED')
    op.execute('ALTER TABLE attempts ALTER COLUMN first_records TYPE jsonb USING CAST(first_records AS jsonb)')
    _views(_0012.FIRST_TRY_LEASES)
