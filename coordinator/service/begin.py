"""Begin checkpoint (DESIGN.md §3 step 2, with the Revisions): the driver's first call of a batch.
It answers skip (already committed, after finishing a decided but unfinished commit) or write
(with an attempt), binds the batch to the offsets Spark planned for it, and, with the partition
count, takes one id per partition for the partitions' first tries (pre-leases), all in one
transaction that also ends every other open attempt of the sink (one micro-batch is in flight per
query). The sink's row is locked FOR SHARE, so begin serialises with a new generation, a lineage
reset and retirement (which lock it FOR UPDATE): a fenced driver's begin changes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Connection

from ..protocol import errors as e
from ..protocol import rules
from ..protocol.model import Attempt, Checkpoint, Lease, Sink
from ..protocol.rules import BeginAction
from ..protocol.states import CheckpointState, LeaseState
from ..store import batches, events, leases, sinks
from . import metrics
from .aborts import Aborter, end_attempts
from .committer import Committer
from .context import ServiceContext, log
from .leasing import lease_rules, take_ids
from .results import BeginResult


@dataclass
class _Begun:
    sink: Sink
    action: BeginAction
    checkpoint: Checkpoint
    attempt: Attempt | None
    to_abort: list[Lease] = field(default_factory=list)  # leases of the attempts this begin ended
    unfinished: list[int] = field(default_factory=list)  # the sink's other decided commits not finished
    older: list[Lease] = field(default_factory=list)  # leases of the batch's earlier attempts, aborted or to abort
    pre_leased: int = 0
    refusal: e.Conflict | None = None  # recorded in the audit trail, then raised
    unchecked: bool = False  # a replay whose offsets could not be checked (no digest on one side)


def begin_checkpoint(ctx: ServiceContext, committer: Committer, aborter: Aborter, name: str, batch_id: int,
                     generation: int, actor: str, partitions: int | None = None,
                     offsets_digest: str | None = None) -> BeginResult:
    if partitions:
        rules.check_partition(partitions - 1, ctx.limits.max_partitions)
    begun = ctx.transaction(lambda conn: _begin(ctx, conn, name, batch_id, generation, actor, partitions,
                                                offsets_digest))
    if begun.unchecked:
        metrics.OFFSETS_UNCHECKED.labels(name).inc()
        log.warning("sink %s: batch %s was begun again without its offsets checked (a begin without a digest: "
                    "the writer's offsets.binding=off); a restored checkpoint would go unnoticed",
                    name, batch_id)
    if begun.refusal is not None:
        metrics.OFFSETS_MISMATCH.labels(name).inc()
        log.error("sink %s: %s", name, begun.refusal.message)
        raise begun.refusal
    finish = [*begun.unfinished, *([begun.checkpoint.id] if begun.action is BeginAction.RESUME else [])]
    try:
        for checkpoint_id in finish:  # decided commits of the sink finish before a new batch writes
            committer.finish(name, checkpoint_id, by="begin")
    except e.Conflict as exc:
        if exc.reason == e.DATA_LOST:
            aborter.abort(begun.sink, begun.to_abort)
            rules.check_not_halted(ctx.read(lambda conn: sinks.sink_by_name(conn, name)))  # the loss halted it: say so
        raise
    aborting = ctx.read(lambda conn: leases.of_checkpoints(conn, finish, [LeaseState.ABORTING])) if finish else []
    if begun.to_abort or aborting:
        aborter.abort(begun.sink, [*begun.to_abort, *aborting])
    if begun.to_abort or finish:  # answer with the states Kafka work left behind
        begun = ctx.read(lambda conn: _reread(conn, begun))
    return BeginResult(
        action=begun.action,
        checkpoint=begun.checkpoint,
        attempt=begun.attempt,
        older_aborted=[x.transactional_id for x in begun.older if x.state is LeaseState.ABORTED],
        older_abort_pending=[x.transactional_id for x in begun.older if x.state is LeaseState.ABORTING],
        pre_leased=begun.pre_leased,
        lease_rules=lease_rules(ctx, begun.sink) if begun.action in (BeginAction.NEW_ATTEMPT, BeginAction.CONTINUE)
        else None,
    )


def _begin(ctx: ServiceContext, conn: Connection, name: str, batch_id: int, generation: int, actor: str,
           partitions: int | None, digest: str | None) -> _Begun:
    sink = sinks.sink_by_name(conn, name, lock="share")
    rules.check_generation(sink.generation, generation)
    rules.check_not_halted(sink)  # lost data: no new batch until an operator acknowledges
    if sink.lineage_query_id is None:  # only after a lineage reset, before a new start
        raise e.Conflict(e.LINEAGE_NOT_BOUND, "no query is bound to this sink; start a generation first")
    now = ctx.clock.now_in(conn)
    cp, created = batches.checkpoint_begun(conn, sink, batch_id, now, digest)
    try:
        checked = rules.check_offsets(cp.offsets_digest, digest, batch_id, replay=not created)
    except e.Conflict as refusal:
        events.add(conn, sink.id, "offsets_mismatch", actor, now, cp.id, batch_id=batch_id, state=str(cp.state),
                   bound_digest=cp.offsets_digest, given_digest=digest)
        return _Begun(sink, BeginAction.SKIP, cp, None, refusal=refusal)
    if not checked:
        events.add(conn, sink.id, "offsets_unchecked", actor, now, cp.id, batch_id=batch_id, state=str(cp.state),
                   bound_digest=cp.offsets_digest, given_digest=digest)
    if cp.offsets_digest is None and digest is not None:
        batches.bind_digest(conn, cp.id, digest)
    latest = batches.latest_attempt(conn, cp) if cp.history_pruned_at is None else None  # pruned: no attempts
    action = rules.decide_begin(cp.state, latest, generation)
    begun = _Begun(sink, action, cp, latest, unchecked=not checked)
    if action is BeginAction.CONTINUE and latest is not None:
        begun.pre_leased = latest.partitions or 0  # the count its first begin took ids for
    if action is BeginAction.NEW_ATTEMPT:
        # one micro-batch in flight per query: every other open attempt of the sink is dead
        begun.to_abort = end_attempts(conn, sink, batches.open_attempts(conn, sink.id), "superseded", now,
                                      "coordinator")
        begun.checkpoint, begun.attempt = batches.insert_attempt(conn, cp, cp.current_attempt + 1, generation,
                                                                 partitions, now)
        if partitions:
            taken = take_ids(conn, sink, partitions, now)
            leases.grant(conn, sink_id=sink.id, checkpoint_id=cp.id, attempt_id=begun.attempt.id,
                         new=[leases.NewLease(ordinal, tid, partition, None) for partition, (ordinal, tid)
                              in enumerate(taken)],
                         now=now, deadline_at=rules.transaction_deadline(now, sink.transaction_timeout_ms))
        begun.pre_leased = partitions or 0
    begun.unfinished = [c.id for c in batches.decided_checkpoints(conn, sink.id)
                        if c.state is CheckpointState.COMMITTING and c.id != cp.id]
    begun.older = [] if created else _older(conn, begun)  # a new batch has no earlier attempts
    return begun


def _older(conn: Connection, begun: _Begun) -> list[Lease]:
    current = begun.attempt.id if begun.attempt is not None else -1
    return [x for x in leases.of_checkpoints(conn, [begun.checkpoint.id], [LeaseState.ABORTED, LeaseState.ABORTING])
            if x.attempt_id != current and x.task_attempt_id is not None]


def _reread(conn: Connection, begun: _Begun) -> _Begun:
    begun.checkpoint = batches.checkpoint_by_id(conn, begun.checkpoint.id)
    if begun.attempt is not None:
        begun.attempt = batches.attempt_by_id(conn, begun.attempt.id)
    begun.older = _older(conn, begun)
    return begun
