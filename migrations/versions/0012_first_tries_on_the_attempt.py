"""first tries on the attempt row: no lease row for a batch that goes the common way

A batch's first task tries (one per partition, pre-leased at begin) cost a row each: inserted at
begin, updated at the decision and again at the committed mark, with their index entries. Now the
attempt row holds them until something unusual happens to one of them:

- `attempts.first_tids`: the first tries' transactional ids, the i-th for partition i (NULL once
  the first tries are lease rows, or when the attempt had none);
- `attempts.first_deadline_at`: their transactions' deadline (all were leased at `started_at`);
- `attempts.first_records`: the decision's pre-commit records, a JSON array by partition (null
  for an empty one), each [producer_id, producer_epoch, records, bytes, write_ms, first_offsets].

The view `first_try_leases` shows them as leases, derived from the attempt: LEASED while it is
OPEN; once decided, a partition with a record is COMMITTING then COMMITTED with its attempt, one
without (an empty partition) ABORTED at the decision. Their ids are 2^50 + attempt id x 2^17 +
partition (max_partitions is at most 100,000 < 2^17), so a read by lease id finds the attempt.
Any other change (a retry's lease, a precommit over HTTP, an abort, a loser, a loss) first copies
the attempt's first tries into `lease_rows` with the same ids and clears the columns above, in the
writer's transaction (repo.materialize_first_tries); an attempt has its first tries in one place
or the other, never both, and never on the row once it ended other than COMMITTED (a CHECK).

- `leases` is renamed `lease_rows` (with its sequence, indexes and constraints);
- the view `leases`: lease_rows and first_try_leases, for reads by attempt or checkpoint (the
  planner pushes those filters into both sides' indexes);
- the view `unresolved_leases`: unresolved lease rows and the first tries of unfinished attempts
  (ix_lease_rows_unresolved and ix_attempts_open), for the recovery loop, scale-down and the
  dashboard. Through `leases`, "unresolved" is a computed state: every attempt would be read.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 00:00:00
"""

from __future__ import annotations

from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

RENAMED_CONSTRAINTS = (  # (as leases, as lease_rows): the names metadata's naming convention gives
    ('pk_leases', 'pk_lease_rows'),
    ('uq_leases_attempt_id_partition_task_attempt_id', 'uq_lease_rows_attempt_id_partition_task_attempt_id'),
    ('fk_leases_attempt_id_attempts', 'fk_lease_rows_attempt_id_attempts'),
    ('ck_leases_resolved', 'ck_lease_rows_resolved'),
    ('ck_leases_state', 'ck_lease_rows_state'),
)

LEASE_COLUMNS = ('id, sink_id, checkpoint_id, attempt_id, partition, task_attempt_id, transactional_id, state, '
                 'leased_at, deadline_at, producer_id, producer_epoch, records, bytes, precommitted_at, resolved_at, '
                 'write_ms, first_offsets')

FIRST_TRY_LEASES = """
CREATE VIEW first_try_leases AS
SELECT 1125899906842624 + a.id * 131072 + (f.n - 1) AS id,
    a.sink_id, a.checkpoint_id, a.id AS attempt_id, CAST(f.n - 1 AS integer) AS partition,
    CAST(-1 AS bigint) AS task_attempt_id, f.tid AS transactional_id,
    CAST(CASE WHEN a.state = 'OPEN' THEN 'LEASED' WHEN r.rec IS NULL THEN 'ABORTED' ELSE a.state END
         AS varchar(16)) AS state,
    a.started_at AS leased_at, a.first_deadline_at AS deadline_at,
    CAST(r.rec ->> 0 AS bigint) AS producer_id, CAST(r.rec ->> 1 AS integer) AS producer_epoch,
    CAST(r.rec ->> 2 AS bigint) AS records, CAST(r.rec ->> 3 AS bigint) AS bytes,
    CASE WHEN r.rec IS NOT NULL THEN a.decided_at END AS precommitted_at,
    CASE WHEN a.state = 'OPEN' THEN NULL WHEN r.rec IS NULL THEN a.decided_at
         WHEN a.state = 'COMMITTED' THEN a.finished_at END AS resolved_at,
    CAST(r.rec ->> 4 AS bigint) AS write_ms, r.rec ->> 5 AS first_offsets,
    a.finished_at AS attempt_finished_at
FROM attempts AS a
CROSS JOIN LATERAL ROWS FROM (unnest(a.first_tids), jsonb_array_elements(a.first_records))
    WITH ORDINALITY AS f(tid, rec, n)
CROSS JOIN LATERAL (SELECT NULLIF(f.rec, 'null') AS rec) AS r
WHERE a.first_tids IS NOT NULL
"""
# ROWS FROM walks the ids and the records side by side, each array read once: a 200-partition
# batch's records are TOASTed, and a lookup per partition (first_records -> partition) read them
# again for every field of every partition (3,600 buffers and ~15 ms to list one attempt's leases).


def upgrade() -> None:
    op.execute('ALTER TABLE leases RENAME TO lease_rows')
    op.execute('ALTER SEQUENCE leases_id_seq RENAME TO lease_rows_id_seq')
    for old, new in RENAMED_CONSTRAINTS:
        op.execute(f'ALTER TABLE lease_rows RENAME CONSTRAINT {old} TO {new}')
    op.execute('ALTER INDEX ix_leases_checkpoint_id RENAME TO ix_lease_rows_checkpoint_id')
    op.execute('ALTER INDEX ix_leases_unresolved RENAME TO ix_lease_rows_unresolved')
    op.execute('ALTER TABLE attempts ADD COLUMN first_tids varchar(255)[], '
               'ADD COLUMN first_deadline_at timestamptz, ADD COLUMN first_records jsonb, '
               "ADD CONSTRAINT ck_attempts_first_tries CHECK (first_tids IS NULL OR state IN "
               "('OPEN', 'COMMITTING', 'COMMITTED'))")
    op.execute(FIRST_TRY_LEASES)
    op.execute(f'CREATE VIEW leases AS SELECT {LEASE_COLUMNS} FROM lease_rows '
               f'UNION ALL SELECT {LEASE_COLUMNS} FROM first_try_leases')
    op.execute(f'CREATE VIEW unresolved_leases AS SELECT {LEASE_COLUMNS} FROM lease_rows WHERE resolved_at IS NULL '
               f'UNION ALL SELECT {LEASE_COLUMNS} FROM first_try_leases '
               'WHERE attempt_finished_at IS NULL AND resolved_at IS NULL')


def downgrade() -> None:
    op.execute('DROP VIEW unresolved_leases')
    op.execute('DROP VIEW leases')
    # the first tries still on attempt rows become lease rows first
    op.execute(f'INSERT INTO lease_rows ({LEASE_COLUMNS}) SELECT {LEASE_COLUMNS} FROM first_try_leases')
    op.execute('DROP VIEW first_try_leases')
    op.execute('ALTER TABLE attempts DROP CONSTRAINT ck_attempts_first_tries, DROP COLUMN first_tids, '
               'DROP COLUMN first_deadline_at, DROP COLUMN first_records')
    op.execute('ALTER INDEX ix_lease_rows_unresolved RENAME TO ix_leases_unresolved')
    op.execute('ALTER INDEX ix_lease_rows_checkpoint_id RENAME TO ix_leases_checkpoint_id')
    for old, new in RENAMED_CONSTRAINTS:
        op.execute(f'ALTER TABLE lease_rows RENAME CONSTRAINT {new} TO {old}')
    op.execute('ALTER SEQUENCE lease_rows_id_seq RENAME TO leases_id_seq')
    op.execute('ALTER TABLE lease_rows RENAME TO leases')
