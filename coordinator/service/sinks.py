"""A sink's life: registration, writer tokens, generations and lineage (DESIGN.md §3 step 1), the
operator's acknowledgement of lost data, and retirement. Each change that every attempt depends on
locks the sink's row FOR UPDATE, so it serialises with the protocol's calls (FOR SHARE)."""

from __future__ import annotations

from dataclasses import asdict

from sqlalchemy import Connection

from ..kafka.control_plane import KafkaTarget
from ..protocol import configuration as config
from ..protocol import errors as e
from ..protocol import rules
from ..protocol.model import Lease, Sink
from ..protocol.states import LeaseState
from ..store import batches, events, leases, sinks
from . import metrics
from .aborts import Aborter, end_attempts
from .context import ServiceContext, log
from .results import AbortOutcome, SinkSpec


def register_sink(ctx: ServiceContext, spec: SinkSpec, actor: str, *, check_broker: bool = True) -> tuple[Sink, bool]:
    """Returns (sink, created). Registering the same spec again returns the same sink. A new sink
    is first checked against its broker (when a control plane is configured)."""
    config.validate_sink_name(spec.name)
    config.validate_prefix(spec.transactional_id_prefix)
    reach = ctx.limits.commit_reach
    margin = spec.commit_margin_ms
    if margin is None:
        margin = config.default_commit_margin_ms(spec.transaction_timeout_ms, reach)
    if reach is not None:
        config.validate_commit_reach(spec.transaction_timeout_ms, margin, reach)
    config.validate_timeouts(spec.transaction_timeout_ms, margin, ctx.limits.broker_max_transaction_timeout_ms)
    values = dict(
        name=spec.name, transactional_id_prefix=spec.transactional_id_prefix, bootstrap_servers=spec.bootstrap_servers,
        topics=list(spec.topics), transaction_timeout_ms=spec.transaction_timeout_ms, commit_margin_ms=margin,
        max_pool_size=spec.max_pool_size or 4 * ctx.limits.max_partitions,
    )
    if check_broker and ctx.control_plane is not None and ctx.read(lambda conn: sinks.sink_row(conn, spec.name)) is None:
        _check_new_sink_broker(ctx, spec)  # a retried registration answers from the record, whatever the broker says

    def step(conn: Connection) -> tuple[Sink, bool]:
        sinks.lock_registrations(conn)
        existing = sinks.sink_row(conn, spec.name)
        if existing is not None:
            if {k: existing[k] for k in values} != values:
                raise e.Conflict(e.SINK_EXISTS, f"a sink named {spec.name!r} exists with a different configuration",
                                 existing={k: existing[k] for k in values})
            return sinks.sink_by_name(conn, spec.name), False  # a retired sink's name stays taken: 409
        clash = sinks.prefix_clash(conn, spec.transactional_id_prefix)
        if clash is not None:
            raise e.Conflict(
                e.PREFIX_CLASH,
                f"transactional_id_prefix {spec.transactional_id_prefix!r} overlaps sink {clash[0]!r}'s prefix "
                f"{clash[1]!r}; prefixes must not start one another, or their transactions could not be told apart",
                other_sink=clash[0],
            )
        now = ctx.clock.now_in(conn)
        sink_id = sinks.insert_sink(conn, values, now)
        events.add(conn, sink_id, "sink_registered", actor, now, **values)
        return sinks.sink_by_name(conn, spec.name), True

    return ctx.transaction(step)


def _check_new_sink_broker(ctx: ServiceContext, spec: SinkSpec) -> None:
    assert ctx.control_plane is not None
    checks = ctx.control_plane.check_broker(KafkaTarget(spec.name, spec.bootstrap_servers, spec.transaction_timeout_ms),
                                            config.transactional_id_stem(spec.transactional_id_prefix), set())
    failed = [c for c in checks if not c.ok and c.verified]
    if failed:
        raise e.Invalid(
            "broker_check_failed",
            "the sink's broker failed its checks: "
            + "; ".join(f"{c.name}: {c.verdict}" + (f" (fix: {c.fix})" if c.fix else "") for c in failed)
            + ". Register with check_broker=false to skip (e.g. before Kafka exists).",
            field="bootstrap_servers",
            checks=[asdict(c) for c in checks],
        )


def rotate_writer_token(ctx: ServiceContext, name: str, actor: str) -> Sink:
    def step(conn: Connection) -> Sink:
        sink = sinks.sink_by_name(conn, name, lock="update")
        sinks.update_sink(conn, sink.id, writer_token_version=sink.writer_token_version + 1)
        events.add(conn, sink.id, "writer_token_rotated", actor, ctx.clock.now_in(conn))
        return sinks.sink_by_name(conn, name)

    return ctx.transaction(step)


def fenced_by(generation: int) -> str:
    return f"fenced_by_generation_{generation}"


def start_generation(ctx: ServiceContext, aborter: Aborter, name: str, query_id: str, run_id: str,
                     actor: str) -> tuple[int, AbortOutcome]:
    """A Spark query (re)started: fence every older driver, bind or check the lineage."""

    def step(conn: Connection) -> tuple[Sink, int, list[Lease]]:
        sink = sinks.sink_by_name(conn, name, lock="update")
        known = sinks.generation_of_run(conn, sink.id, run_id)
        if known is not None:
            rules.check_generation(sink.generation, known)  # a retry answers the same
            return sink, known, []
        rules.check_lineage(sink.lineage_query_id, query_id)
        now = ctx.clock.now_in(conn)
        generation = sinks.start_generation(conn, sink, query_id, run_id, now)
        to_abort = end_attempts(conn, sink, batches.open_attempts(conn, sink.id), fenced_by(generation), now, "coordinator")
        events.add(conn, sink.id, "generation_started", actor, now, generation=generation, query_id=query_id,
                   run_id=run_id)
        return sink, generation, to_abort

    sink, generation, to_abort = ctx.transaction(step)
    aborter.abort(sink, to_abort)
    # answered from the record, so a retry gets the same answer
    fenced = ctx.read(lambda conn: leases.of_attempts_aborted_for(conn, sink.id, fenced_by(generation)))
    return generation, AbortOutcome(aborted=[x.transactional_id for x in fenced if x.state is LeaseState.ABORTED],
                                    pending=[x.transactional_id for x in fenced if x.state is LeaseState.ABORTING])


def reset_lineage(ctx: ServiceContext, aborter: Aborter, name: str, actor: str, reason: str) -> Sink:
    """Operator action: let a query with a new checkpoint location take over the sink. Fences the
    current driver and aborts whatever it has open."""

    def step(conn: Connection) -> tuple[Sink, list[Lease]]:
        sink = sinks.sink_by_name(conn, name, lock="update")
        committing = batches.committing_batches(conn, sink.id)
        if committing:
            raise e.Conflict(e.COMMIT_IN_PROGRESS,
                             f"batches {committing} have a decided commit still finishing; resume them first",
                             batch_ids=committing)
        now = ctx.clock.now_in(conn)
        to_abort = end_attempts(conn, sink, batches.open_attempts(conn, sink.id), "lineage_reset", now, "coordinator")
        sinks.update_sink(conn, sink.id, generation=sink.generation + 1, lineage_query_id=None)
        events.add(conn, sink.id, "lineage_reset", actor, now, previous_query_id=sink.lineage_query_id, reason=reason)
        return sink, to_abort

    sink, to_abort = ctx.transaction(step)
    aborter.abort(sink, to_abort)
    return ctx.read(lambda conn: sinks.sink_by_name(conn, name))


def acknowledge_lost_data(ctx: ServiceContext, name: str, actor: str, reason: str,
                          operator: str | None = None) -> tuple[Sink, bool, list[int]]:
    """Operator action: clear a sink's lost-data halt. Returns the sink, whether it was halted,
    and the batch ids of the sink's LOST checkpoints (a retried acknowledgement, or one of a sink
    that is not halted, changes nothing and answers False)."""

    def step(conn: Connection) -> tuple[Sink, bool, list[int]]:
        sink = sinks.sink_by_name(conn, name, lock="update")
        if sink.halted_at is None:
            return sink, False, []
        lost = batches.lost_batches(conn, sink.id)
        now = ctx.clock.now_in(conn)
        sinks.update_sink(conn, sink.id, halted_reason=None, halted_at=None)
        events.add(conn, sink.id, "lost_data_acknowledged", actor, now, reason=reason, operator=operator,
                   halted_reason=sink.halted_reason, halted_at=sink.halted_at.isoformat(), lost_batches=lost)
        return sinks.sink_by_name(conn, name), True, lost

    sink, was_halted, lost = ctx.transaction(step)
    if was_halted:
        metrics.LOST_DATA_ACKNOWLEDGED.labels(name).inc()
        log.warning("sink %s: lost data acknowledged by %s (%s): %s", name, actor, operator, reason)
    return sink, was_halted, lost


def retire_sink(ctx: ServiceContext, name: str, actor: str, reason: str) -> tuple[Sink, bool]:
    """Once nothing of the sink can be open, mark it retired: its row, checkpoints and event trail
    stay, its name and prefix stay reserved, and every later call naming it is answered 409
    sink_retired. Returns (sink, retired now); retiring it again answers from the record."""

    def step(conn: Connection) -> tuple[Sink, bool]:
        sink = sinks.sink_by_name(conn, name, lock="update", retired=True)
        if sink.retired_at is not None:
            return sink, False
        blockers = rules.retirement_blockers(
            open_attempts=batches.count_open_attempts(conn, sink.id),
            committing_checkpoints=len(batches.committing_batches(conn, sink.id)),
            unresolved_leases=leases.count_unresolved(conn, sink.id),
        )
        if blockers:
            raise e.Conflict(e.RETIREMENT_BLOCKED, f"sink {name!r} cannot be retired yet: " + "; ".join(blockers),
                             blockers=blockers)
        now = ctx.clock.now_in(conn)
        sinks.update_sink(conn, sink.id, retired_at=now)
        events.add(conn, sink.id, "sink_retired", actor, now, reason=reason)
        return sinks.sink_by_name(conn, name, retired=True), True

    retired = ctx.transaction(step)
    metrics.forget_sink(name)  # its halt and other last-seen gauges would stay as they were
    return retired

