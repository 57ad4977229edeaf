"""A task try's lease (DESIGN.md §3 step 3, with the Revisions): every try that has rows to write
asks for one, naming itself by Spark's task attempt id. The first try to ask claims its partition's
pre-lease; any other try (a retry, a speculative copy, a try of a resubmitted stage) gets a fresh id
from the pool, so no two tries ever write on one id and a record names the try that holds its
lease. A retried request answers the same lease. The lease is durable before the try's producer
exists, so the coordinator knows every id that may hold a transaction (I3, scale-down)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from ..protocol import rules
from ..protocol.configuration import transactional_id_for
from ..protocol.model import Lease, Sink
from ..protocol.rules import LeaseAction
from ..protocol.states import LeaseState
from ..store import batches, leases, pool
from .context import ServiceContext
from .results import LeaseGrant, LeaseRules


def lease_for_try(ctx: ServiceContext, name: str, batch_id: int, attempt_number: int, generation: int,
                  partition: int, task_attempt_id: int) -> LeaseGrant:
    rules.check_partition(partition, ctx.limits.max_partitions)

    def step(conn: Connection) -> LeaseGrant:
        rows = batches.attempt_rows(conn, name, batch_id, attempt_number, lock="share")
        sink, cp, attempt = rows.sink, rows.checkpoint, rows.attempt
        rules.check_generation(sink.generation, generation)
        held = leases.of_partition(conn, attempt.id, partition, lock=True)
        own = next((x for x in held if x.task_attempt_id == task_attempt_id), None)
        pre_lease = next((x for x in held if x.state is LeaseState.PRELEASED), None)
        action = rules.decide_lease(own, pre_lease)
        now = ctx.clock.now_in(conn)
        if action is LeaseAction.AGAIN:
            assert own is not None
            return _grant(ctx, sink, own, attempt_number, now)
        rules.check_attempt_writable(attempt, cp.current_attempt, generation)
        deadline = rules.transaction_deadline(now, sink.transaction_timeout_ms)
        if action is LeaseAction.CLAIM:
            assert pre_lease is not None
            claimed = leases.claim(conn, pre_lease, task_attempt_id, now, deadline)
            assert claimed is not None, "the pre-lease changed under its lock"
            return _grant(ctx, sink, claimed, attempt_number, now)
        ((ordinal, tid),) = take_ids(conn, sink, 1, now)
        (lease,) = leases.grant(conn, sink_id=sink.id, checkpoint_id=cp.id, attempt_id=attempt.id,
                                new=[leases.NewLease(ordinal, tid, partition, task_attempt_id)], now=now,
                                deadline_at=deadline)
        return _grant(ctx, sink, lease, attempt_number, now)

    try:
        return ctx.transaction(step)
    except IntegrityError:
        # a concurrent copy of this very request (no pre-lease) took its lease first: answer it
        return ctx.transaction(step)


def take_ids(conn: Connection, sink: Sink, count: int, now: datetime) -> list[tuple[int, str]]:
    """`count` free ids of the sink's pool (ordinal, transactional id), the pool's row locked and
    moved on (lock order: after the sink, the attempt and its leases)."""
    picked = rules.pick_ids(pool.lock(conn, sink.id), pool.busy(conn, sink.id, now), count, sink.max_pool_size)
    pool.save(conn, picked.pool)
    return [(n, transactional_id_for(sink.transactional_id_prefix, n)) for n in picked.ordinals]


def lease_rules(ctx: ServiceContext, sink: Sink) -> LeaseRules:
    return LeaseRules(
        commit_margin_ms=sink.commit_margin_ms,
        max_lease_init_age_ms=ctx.limits.lease_max_init_age_ms,
        producer_init_timeout_ms=ctx.limits.producer_init_timeout_ms,
        producer_request_timeout_ms=ctx.limits.producer_request_timeout_ms,
    )


def _grant(ctx: ServiceContext, sink: Sink, lease: Lease, attempt: int, now: datetime) -> LeaseGrant:
    return LeaseGrant(lease, attempt, age_ms=max(0, int((now - lease.leased_at) / timedelta(milliseconds=1))),
                      transaction_timeout_ms=sink.transaction_timeout_ms, rules=lease_rules(ctx, sink))
