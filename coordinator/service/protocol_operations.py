"""The protocol operations a Spark driver and its executors call, in protocol order: register a
sink, start a generation (or reset the lineage), begin a checkpoint, lease a transactional id per
partition, pre-commit, commit (or resume a decided commit), abort; and the operator's
acknowledgement of lost data.

Long because these operations are the protocol's sequence of calls, each one transaction, kept
in the order a batch goes through them; the reads they share are in reads.py, recovery in
recovery_operations.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from dataclasses import asdict, replace
from datetime import datetime

from sqlalchemy import Connection, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from ..kafka.control_plane import KafkaTarget
from ..protocol import errors as e
from ..protocol import rules
from ..protocol.model import FIRST_TRY_TASK_ATTEMPT, Attempt, Checkpoint, Lease, PartitionResult, PrecommitRecord, Sink
from ..protocol.rules import BeginAction, PrecommitRequest
from ..protocol.states import LOST_LEASE_STATES, UNDECIDED_LEASE_STATES, AttemptState, CheckpointState, LeaseState
from .clock import given_now, now_from
from ..store import hot_path, repo
from ..store.hot_path import NewAttempt
from ..store.tables import attempts, checkpoints, generations, lease_rows, leases, sinks
from . import metrics
from .base import log
from .reads import Reads
from .results import AbortOutcome, BeginResult, CommitResult, SinkSpec, _Decision


def _decision_of(decided: hot_path.FirstTriesDecided) -> _Decision:
    return _Decision(decided.head.sink, decided.checkpoint, decided.attempt, decided.winners, decided.unused)


class ProtocolOperations(Reads):
    """What a driver and its executors call (on Reads: it looks sinks up with get_sink)."""

    # --- sinks -------------------------------------------------------------------------------

    def register_sink(self, spec: SinkSpec, actor: str, *, check_broker: bool = True) -> tuple[Sink, bool]:
        """Returns (sink, created). Registering the same spec again returns the same sink. A new
        sink is first checked against its broker (when a control plane is configured)."""
        rules.validate_sink_name(spec.name)
        rules.validate_prefix(spec.transactional_id_prefix)
        margin = spec.commit_margin_ms
        if margin is None:
            margin = rules.default_commit_margin_ms(spec.transaction_timeout_ms, self.limits.commit_reach)
        if self.limits.commit_reach is not None:
            rules.validate_commit_reach(spec.transaction_timeout_ms, margin, self.limits.commit_reach)
        rules.validate_timeouts(spec.transaction_timeout_ms, margin, self.limits.broker_max_transaction_timeout_ms)
        if check_broker and self.control_plane is not None:
            with self.engine.connect() as conn:
                known = conn.execute(select(sinks.c.id).where(sinks.c.name == spec.name)).first() is not None
            if not known:  # a retried registration answers from the record, whatever the broker says now
                self._check_new_sink_broker(spec)
        max_pool = spec.max_pool_size or 4 * self.limits.max_partitions
        values = dict(
            name=spec.name,
            transactional_id_prefix=spec.transactional_id_prefix,
            bootstrap_servers=spec.bootstrap_servers,
            topics=list(spec.topics),
            transaction_timeout_ms=spec.transaction_timeout_ms,
            commit_margin_ms=margin,
            max_pool_size=max_pool,
        )

        def step(conn: Connection) -> tuple[Sink, bool]:
            # one registration at a time: the prefix-clash check reads all prefixes
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('coordinator.sink_registration'))"))
            existing = conn.execute(select(sinks).where(sinks.c.name == spec.name)).first()
            if existing is not None:
                if {k: existing._mapping[k] for k in values} != values:
                    raise e.Conflict(
                        e.SINK_EXISTS,
                        f"a sink named {spec.name!r} exists with a different configuration",
                        existing={k: existing._mapping[k] for k in values},
                    )
                return repo.sink_by_name(conn, spec.name), False
            clash = conn.execute(
                select(sinks.c.name, sinks.c.transactional_id_prefix).where(
                    func.starts_with(sinks.c.transactional_id_prefix, spec.transactional_id_prefix)
                    | func.starts_with(spec.transactional_id_prefix, sinks.c.transactional_id_prefix)
                )
            ).first()
            if clash is not None:
                raise e.Conflict(
                    e.PREFIX_CLASH,
                    f"transactional_id_prefix {spec.transactional_id_prefix!r} overlaps sink "
                    f"{clash.name!r}'s prefix {clash.transactional_id_prefix!r}; prefixes must not "
                    "start one another, or their transactions could not be told apart",
                    other_sink=clash.name,
                )
            now = self.clock.now_in(conn)
            sink_id = conn.execute(insert(sinks).values(created_at=now, **values).returning(sinks.c.id)).scalar_one()
            repo.add_event(conn, sink_id, "sink_registered", actor, now, **values)
            return repo.sink_by_name(conn, spec.name), True

        return self._tx(step)

    def _check_new_sink_broker(self, spec: SinkSpec) -> None:
        assert self.control_plane is not None
        target = KafkaTarget(spec.name, spec.bootstrap_servers, spec.transaction_timeout_ms)
        checks = self.control_plane.check_broker(target, rules.transactional_id_stem(spec.transactional_id_prefix), set())
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

    def rotate_writer_token(self, name: str, actor: str) -> Sink:
        def step(conn: Connection) -> Sink:
            sink = repo.sink_by_name(conn, name, lock="update")
            conn.execute(
                update(sinks).where(sinks.c.id == sink.id).values(writer_token_version=sink.writer_token_version + 1)
            )
            repo.add_event(conn, sink.id, "writer_token_rotated", actor, self.clock.now_in(conn))
            return repo.sink_by_name(conn, name)

        return self._tx(step)

    # --- generations and lineage --------------------------------------------------------------

    def start_generation(self, name: str, query_id: str, run_id: str, actor: str) -> tuple[int, AbortOutcome]:
        """A Spark query (re)started: fence every older driver, bind or check the lineage."""

        def step(conn: Connection) -> tuple[int, list[Lease]]:
            sink = repo.sink_by_name(conn, name, lock="update")
            known = conn.execute(
                select(generations.c.generation).where(generations.c.sink_id == sink.id, generations.c.run_id == run_id)
            ).scalar()
            if known is not None:
                rules.check_generation(sink.generation, known)  # a retry answers the same
                return known, []
            rules.check_lineage(sink.lineage_query_id, query_id)
            now = self.clock.now_in(conn)
            gen = sink.generation + 1
            conn.execute(update(sinks).where(sinks.c.id == sink.id).values(generation=gen, lineage_query_id=query_id))
            conn.execute(
                insert(generations).values(sink_id=sink.id, generation=gen, query_id=query_id, run_id=run_id, started_at=now)
            )
            to_abort = self._abort_open_attempts(conn, sink, _fenced_by(gen), now)
            repo.add_event(conn, sink.id, "generation_started", actor, now, generation=gen, query_id=query_id, run_id=run_id)
            return gen, to_abort

        gen, to_abort = self._tx(step)
        self._abort_on_kafka(name, to_abort)
        # answered from the record, so a retry gets the same answer
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            fenced = repo.leases_where(
                conn,
                leases.c.sink_id == sink.id,
                leases.c.attempt_id.in_(
                    select(attempts.c.id).where(attempts.c.sink_id == sink.id, attempts.c.abort_reason == _fenced_by(gen))
                ),
                leases.c.state.in_([LeaseState.ABORTED.value, LeaseState.ABORTING.value]),
            )
        return gen, AbortOutcome(
            aborted=[x.transactional_id for x in fenced if x.state is LeaseState.ABORTED],
            pending=[x.transactional_id for x in fenced if x.state is LeaseState.ABORTING],
        )

    def reset_lineage(self, name: str, actor: str, reason: str) -> Sink:
        """Operator action: let a query with a new checkpoint location take over the sink. Fences
        the current driver and aborts whatever it has open."""

        def step(conn: Connection) -> list[Lease]:
            sink = repo.sink_by_name(conn, name, lock="update")
            committing = conn.execute(
                select(checkpoints.c.batch_id).where(
                    checkpoints.c.sink_id == sink.id, checkpoints.c.state == CheckpointState.COMMITTING.value
                )
            ).scalars().all()
            if committing:
                raise e.Conflict(
                    e.COMMIT_IN_PROGRESS,
                    f"batches {list(committing)} have a decided commit still finishing; resume them first",
                    batch_ids=list(committing),
                )
            now = self.clock.now_in(conn)
            to_abort = self._abort_open_attempts(conn, sink, "lineage_reset", now)
            conn.execute(
                update(sinks).where(sinks.c.id == sink.id).values(generation=sink.generation + 1, lineage_query_id=None)
            )
            repo.add_event(
                conn, sink.id, "lineage_reset", actor, now, previous_query_id=sink.lineage_query_id, reason=reason
            )
            return to_abort

        to_abort = self._tx(step)
        self._abort_on_kafka(name, to_abort)
        return self.get_sink(name)

    # --- begin checkpoint ---------------------------------------------------------------------

    def begin_checkpoint(
        self, name: str, batch_id: int, generation: int, actor: str,
        partitions: int | None = None, offsets_digest: str | None = None,
    ) -> BeginResult:
        """Begin (or continue, skip, resume) a batch. With `partitions`, a write answer carries the
        lease of each partition's first task try, taken in the same transaction as the attempt (so
        durable before any producer exists); a retried begin answers the same leases.
        `offsets_digest` binds the batch to the offsets Spark planned for it (first begin that names
        them); a begin over other offsets is refused loudly (offsets_mismatch event, metric)."""
        if partitions is not None and partitions != 0:
            rules.check_partition(partitions - 1, self.limits.max_partitions)
        mismatch: list[e.Conflict] = []

        fresh: list[tuple[NewAttempt, Sink]] = []  # a new attempt's row and pre-leases, as its own statement wrote them

        def step(conn: Connection) -> tuple[BeginAction, Checkpoint, Attempt | None, list[Lease], list[int], list[Any]]:
            mismatch.clear()
            fresh.clear()
            # the sink, and the checkpoint (created if new, locked) with what the rest of this step
            # reads; a refusal below rolls a new checkpoint back
            found = hot_path.begin_head(conn, name, batch_id, given_now(self.clock, conn), offsets_digest,
                                        ids=partitions or 0)
            if found is None or found.sink.retired_at is not None:
                repo.sink_by_name(conn, name)  # raises the error that says which
                raise AssertionError("unreachable")
            sink, head = found.sink, found.head
            rules.check_generation(sink.generation, generation)
            rules.check_not_halted(sink)  # lost data: no new batch until an operator acknowledges
            if sink.lineage_query_id is None:  # only after a lineage reset, before a new start
                raise e.Conflict(e.LINEAGE_NOT_BOUND, "no query is bound to this sink; start a generation first")
            assert head is not None  # a live sink with a query bound gets its checkpoint
            now = now_from(self.clock, conn, found.db_now)
            cp, latest = head.checkpoint, head.latest
            try:
                rules.check_offsets(cp.offsets_digest, offsets_digest, batch_id)
            except e.Conflict as refusal:  # recorded (this transaction commits), then raised
                mismatch.append(refusal)
                repo.add_event(conn, sink.id, "offsets_mismatch", actor, now, cp.id, batch_id=batch_id,
                               state=str(cp.state), bound_digest=cp.offsets_digest, given_digest=offsets_digest)
                return BeginAction.SKIP, cp, None, [], [], []
            action = rules.decide_begin(cp.state, latest, generation)
            to_abort: list[Lease] = []
            if action is BeginAction.NEW_ATTEMPT:
                # one micro-batch in flight per query: every other open attempt of the sink is dead
                if head.open_attempt_ids:
                    to_abort = self._abort_open_attempts(conn, sink, "superseded", now)
                number = cp.current_attempt + 1
                taken = repo.take_free_transactional_ids(
                    conn, sink, partitions, now, lambda n: rules.transactional_id_for(sink.transactional_id_prefix, n),
                    locked=found.locked_ids,
                ) if partitions else []
                made = hot_path.insert_attempt_with_leases(
                    conn, sink=sink, checkpoint_id=cp.id, number=number, generation=generation, partitions=partitions,
                    now=now, taken=taken, deadline_at=rules.transaction_deadline(now, sink.transaction_timeout_ms),
                    commit=not head.open_attempt_ids,  # nothing follows it below
                )
                fresh.append((made, sink))
                latest = made.attempt
                cp = replace(cp, current_attempt=number)
            if head.open_attempt_ids:  # leases of earlier attempts may have changed since they were read
                older: list[Any] = self._older_leases(conn, cp.id, latest)
            else:
                current = latest.id if latest else -1
                older = [x for x in head.ended_leases if x.attempt_id != current]
            return action, cp, latest, to_abort, head.unfinished_ids, older

        def new_batch(conn: Connection) -> hot_path.NewBatch | None:
            assert partitions
            return hot_path.begin_new_batch(conn, name=name, batch_id=batch_id, generation=generation,
                                            partitions=partitions, now=given_now(self.clock, conn),
                                            offsets_digest=offsets_digest)

        # the common case, a new batch, in one round trip; anything else (nothing written) as above
        new = self._tx(new_batch) if partitions else None
        if new is not None:
            fresh[:] = [(new.made, new.sink)]
            action, cp, attempt, to_abort, unfinished, older = (
                BeginAction.NEW_ATTEMPT, new.checkpoint, new.made.attempt, [], new.unfinished_ids, [])
        else:
            action, cp, attempt, to_abort, unfinished, older = self._tx(step)
        if mismatch:
            metrics.OFFSETS_MISMATCH.labels(name).inc()
            log.error("sink %s: %s", name, mismatch[0].message)
            raise mismatch[0]
        finished = list(unfinished)
        try:
            for other in unfinished:  # decided commits of earlier batches finish first
                self._finish_commit(name, other, "begin")
            if action is BeginAction.RESUME:
                self._finish_commit(name, cp.id, "begin")
                finished.append(cp.id)
        except e.Conflict as exc:
            if exc.reason != e.DATA_LOST:
                raise
            self._abort_on_kafka(name, to_abort)
            rules.check_not_halted(self.get_sink(name))  # the loss just halted the sink: say so
            raise
        # a finished commit's losers (left ABORTING when its first try failed) end too, as in resume
        kafka_work = [*to_abort, *self._aborting_leases(finished)]
        if kafka_work or action is BeginAction.RESUME:
            self._abort_on_kafka(name, kafka_work)
            with self.engine.connect() as conn:  # answer with the states Kafka work left behind
                cp = repo.checkpoint_for(conn, repo.sink_by_name(conn, name), batch_id)
                attempt = repo.attempt_of(conn, cp.id, cp.current_attempt) if cp.current_attempt else None
                older = self._older_leases(conn, cp.id, attempt)
        pre_leases: list[Lease] = []
        answered_at = lease_rules = None
        answer_sink: Sink | None = None
        if fresh and not kafka_work:  # nothing changed what this step wrote: answer with it
            made, answer_sink = fresh[0]
            pre_leases = made.leases
            answered_at = now_from(self.clock, None, made.answered_at) if pre_leases else None  # type: ignore[arg-type]
        elif attempt is not None and action in (BeginAction.NEW_ATTEMPT, BeginAction.CONTINUE):
            with self.engine.connect() as conn:  # answered from the record: a retry gets the same leases
                pre_leases = repo.leases_where(
                    conn, leases.c.attempt_id == attempt.id, leases.c.task_attempt_id == FIRST_TRY_TASK_ATTEMPT,
                    leases.c.state == LeaseState.LEASED.value,
                )
                answered_at = self.clock.now_in(conn) if pre_leases else None
                answer_sink = repo.sink_by_name(conn, name)
        if answer_sink is not None:
            lease_rules = dict(
                commit_margin_ms=answer_sink.commit_margin_ms,
                max_lease_init_age_ms=self.limits.lease_max_init_age_ms,
                producer_init_timeout_ms=self.limits.producer_init_timeout_ms,
                producer_request_timeout_ms=self.limits.producer_request_timeout_ms,
            )
        return BeginResult(
            action=action,
            checkpoint=cp,
            attempt=attempt,
            older_aborted=[x.transactional_id for x in older if x.state is LeaseState.ABORTED],
            older_abort_pending=[x.transactional_id for x in older if x.state is LeaseState.ABORTING],
            pre_leases=pre_leases,
            answered_at=answered_at,
            lease_rules=lease_rules,
        )

    @staticmethod
    def _older_leases(conn: Connection, checkpoint_id: int, current: Attempt | None) -> list[Lease]:
        """Leases of the checkpoint's earlier attempts that were aborted or are still to abort."""
        return repo.leases_where(
            conn,
            leases.c.checkpoint_id == checkpoint_id,
            leases.c.attempt_id != (current.id if current else -1),
            leases.c.state.in_([LeaseState.ABORTED.value, LeaseState.ABORTING.value]),
        )

    def _abort_open_attempts(self, conn: Connection, sink: Sink, reason: str, now: datetime) -> list[Lease]:
        """Abort every OPEN attempt of the sink (one micro-batch is in flight per query, so any
        other open attempt is dead once a new one begins or a new generation starts)."""
        open_ids = conn.execute(
            select(attempts.c.id)
            .where(attempts.c.sink_id == sink.id, attempts.c.state == AttemptState.OPEN.value,
                   attempts.c.finished_at.is_(None))  # finished_at: the partial index ix_attempts_open
            .order_by(attempts.c.id)
            .with_for_update()
        ).scalars().all()
        return self._abort_attempt_rows(conn, sink, list(open_ids), reason, now, "coordinator")

    def _abort_attempt_rows(
        self, conn: Connection, sink: Sink, attempt_ids: list[int], reason: str, now: datetime, actor: str
    ) -> list[Lease]:
        """Mark the attempts ABORTED and their undecided leases ABORTING; returns the leases whose
        transactions must now be aborted on Kafka. Their ids stay LEASED until that is done, so
        none is re-leased while it may hold a transaction (I3, and scale-down for free)."""
        repo.materialize_first_tries(conn, attempt_ids)  # before the attempts end: their first tries change
        aborted = repo.cas(
            conn, attempts, attempt_ids, [AttemptState.OPEN], AttemptState.ABORTED, finished_at=now, abort_reason=reason
        )
        if not aborted:
            return []
        undecided = repo.leases_where(
            conn,
            lease_rows.c.attempt_id.in_([a.id for a in aborted]),
            lease_rows.c.resolved_at.is_(None),
            lease_rows.c.state.in_([s.value for s in UNDECIDED_LEASE_STATES]),
            source=lease_rows,
            lock=True,
        )
        changed = repo.cas(conn, lease_rows, [x.id for x in undecided], UNDECIDED_LEASE_STATES, LeaseState.ABORTING)
        for a in aborted:
            repo.add_event(conn, sink.id, "attempt_aborted", actor, now, a.checkpoint_id, attempt=a.number, reason=reason)
        return [repo.as_lease(r) for r in changed]

    # --- leases -------------------------------------------------------------------------------

    def begin_partition(
        self, name: str, batch_id: int, attempt_number: int, generation: int, partition: int, task_attempt_id: int
    ) -> Lease:
        """Lease a transactional id to one task attempt of one partition."""
        rules.check_partition(partition, self.limits.max_partitions)
        if task_attempt_id == FIRST_TRY_TASK_ATTEMPT:
            raise e.Invalid("invalid_task_attempt_id", f"task_attempt_id {task_attempt_id} is reserved for the "
                            "leases begin takes for first task tries", field="task_attempt_id")

        def existing(conn: Connection, attempt_id: int) -> Lease | None:
            found = repo.leases_where(
                conn,
                leases.c.attempt_id == attempt_id,
                leases.c.partition == partition,
                leases.c.task_attempt_id == task_attempt_id,
            )
            if not found:
                return None
            lease = found[0]
            if lease.state not in (LeaseState.LEASED, LeaseState.PRECOMMITTED):
                raise e.Conflict(e.STALE_LEASE, f"lease {lease.id} is {lease.state}", lease_id=lease.id, lease_state=str(lease.state))
            return lease

        def step(conn: Connection) -> Lease:
            sink = repo.sink_by_name(conn, name)
            rules.check_generation(sink.generation, generation)
            cp = repo.checkpoint_for(conn, sink, batch_id)
            attempt = repo.attempt_of(conn, cp.id, attempt_number, lock="key_share")
            again = existing(conn, attempt.id)
            if again is not None:
                return again
            rules.check_attempt_writable(attempt, cp.current_attempt, generation)
            repo.materialize_first_tries(conn, [attempt.id])  # a lease row joins them: all are rows
            now = self.clock.now_in(conn)
            ((tid_row, tid),) = repo.take_free_transactional_ids(
                conn, sink, 1, now, lambda n: rules.transactional_id_for(sink.transactional_id_prefix, n)
            )
            row = conn.execute(
                insert(lease_rows)
                .values(
                    sink_id=sink.id,
                    checkpoint_id=cp.id,
                    attempt_id=attempt.id,
                    partition=partition,
                    task_attempt_id=task_attempt_id,
                    transactional_id=tid,
                    state=LeaseState.LEASED.value,
                    leased_at=now,
                    deadline_at=rules.transaction_deadline(now, sink.transaction_timeout_ms),
                )
                .returning(*lease_rows.c)
            ).one()
            repo.hand_out_transactional_ids(conn, [(tid_row, row.id)])
            return repo.as_lease(row)

        try:
            return self._tx(step)
        except IntegrityError:
            # a concurrent copy of this very request won the unique (attempt, partition, task attempt)
            def again(conn: Connection) -> Lease:
                sink = repo.sink_by_name(conn, name)
                cp = repo.checkpoint_for(conn, sink, batch_id)
                lease = existing(conn, repo.attempt_of(conn, cp.id, attempt_number).id)
                assert lease is not None
                return lease

            return self._tx(again)

    def precommit(self, name: str, lease_id: int, generation: int, request: PrecommitRequest) -> Lease:
        """Store the flushed transaction's producer id, epoch and counts durably."""

        def step(conn: Connection) -> Lease:
            sink = repo.sink_by_name(conn, name)
            rules.check_generation(sink.generation, generation)
            attempt = repo.attempt_of_lease(conn, sink, lease_id, lock="key_share")  # lock order: attempt first
            repo.materialize_first_tries(conn, [attempt.id])  # a first try changes alone: all become rows
            lease = repo.lease_by_id(conn, sink, lease_id, lock=True)
            if rules.precommit_already_recorded(lease, request):
                return lease
            cp_current = conn.execute(
                select(checkpoints.c.current_attempt).where(checkpoints.c.id == lease.checkpoint_id)
            ).scalar_one()
            rules.check_attempt_writable(attempt, cp_current, generation)
            now = self.clock.now_in(conn)
            rules.check_precommit(lease, now, sink.commit_margin_ms)
            (row,) = repo.cas(
                conn,
                lease_rows,
                [lease.id],
                [LeaseState.LEASED],
                LeaseState.PRECOMMITTED,
                producer_id=request.producer_id,
                producer_epoch=request.producer_epoch,
                records=request.records,
                bytes=request.bytes,
                write_ms=request.write_ms,
                precommitted_at=now,
            )
            return repo.as_lease(row)

        return self._tx(step)

    # --- commit -------------------------------------------------------------------------------

    def commit(
        self,
        name: str,
        batch_id: int,
        attempt_number: int,
        generation: int,
        results: Sequence[PartitionResult],
        actor: str,
        job_ms: int | None = None,
    ) -> CommitResult:
        """Decide and finish the commit of an attempt. `job_ms` (the driver's write-job time) is
        stored on the attempt with the decision, for operators' throughput figures."""
        if self.control_plane is None:
            raise e.Unavailable(
                e.NO_CONTROL_PLANE,
                "the coordinator has no Kafka control plane configured (COORDINATOR_KAFKA_CONTROL_PLANE), "
                "so it cannot commit; nothing was decided",
            )

        def step(conn: Connection) -> tuple[int, _Decision | None, list[Lease], e.ProtocolError | None]:
            head = hot_path.commit_head(conn, name, batch_id, attempt_number)  # all three locked, one round trip
            if head is None:  # one of them is missing (or the sink retired): read them one by one for the error
                sink = repo.sink_by_name(conn, name, lock="share")
                rules.check_generation(sink.generation, generation)
                cp = repo.checkpoint_for(conn, sink, batch_id, lock=True)
                attempt = repo.attempt_of(conn, cp.id, attempt_number, lock="update")
            else:
                sink, cp, attempt = head.sink, head.checkpoint, head.attempt
                rules.check_generation(sink.generation, generation)
            if cp.state is not CheckpointState.OPEN:
                if cp.committed_attempt != attempt_number:
                    raise e.Conflict(
                        e.COMMIT_DECIDED,
                        f"batch {batch_id} was committed by attempt {cp.committed_attempt}",
                        committed_attempt=cp.committed_attempt,
                    )
                decided = repo.leases_where(  # the winners, including any Kafka refused (lost)
                    conn,
                    leases.c.attempt_id == attempt.id,
                    leases.c.state.in_([s.value for s in (LeaseState.COMMITTING, LeaseState.COMMITTED, *LOST_LEASE_STATES)]),
                )
                rules.check_same_winners(results, decided)
                # a retry: finish (if needed), end the losers' transactions still to abort, and
                # answer from the record
                return cp.id, None, self._aborting_leases([cp.id], conn), None
            if attempt.state is AttemptState.ABORTED and attempt.abort_reason == e.DEADLINE_TOO_CLOSE:
                raise e.Conflict(e.DEADLINE_TOO_CLOSE, f"attempt {attempt_number} was aborted by the timeout gate")
            rules.check_attempt_writable(attempt, cp.current_attempt, generation)
            if head is not None and head.first_tries is not None:  # the common path: read with the locks
                locked = hot_path.AttemptLeases(head.first_tries, True, head.db_now)
            else:
                locked = hot_path.lock_attempt_leases(conn, attempt.id)  # the clock read after the locks
            attempt_leases, now = locked.leases, now_from(self.clock, conn, locked.db_now)
            try:
                plan = rules.plan_commit(attempt_leases, results, self.limits.max_partitions)
            except e.Conflict as refusal:
                named = {x.id: x for x in attempt_leases}.get(refusal.detail.get("lease_id", -1))
                if refusal.reason != e.WINNER_NOT_PRECOMMITTED or named is None:
                    raise
                if not rules.winner_expired(named, now, sink.commit_margin_ms):
                    raise
                # the recovery loop aborted it because it could no longer pass the timeout gate
                plan = rules.CommitPlan(winners=(named,), losers=())
            try:
                rules.check_commit_deadlines(plan.winners, now, sink.commit_margin_ms)
            except e.Conflict as refusal:
                to_abort = self._abort_attempt_rows(conn, sink, [attempt.id], e.DEADLINE_TOO_CLOSE, now, actor)
                repo.add_event(conn, sink.id, "commit_refused", actor, now, cp.id, attempt=attempt_number, **refusal.to_dict())
                return cp.id, None, to_abort, refusal
            # the common path keeps the first tries on the attempt's row: every winner one of them, with
            # its record; otherwise they become lease rows before anything changes them
            recorded = {lease.id for lease, _ in plan.records}
            if locked.on_row and not plan.losers and len(recorded) == len(plan.winners):
                records: list[PrecommitRecord | None] = [None] * len(attempt_leases)
                for lease, r in plan.records:
                    records[lease.partition] = r
                request = hot_path.FirstTriesCommit(attempt.id, records, [x.partition for x in plan.unused], len(results))
                on_row = hot_path.decide_first_tries(conn, request, name=name, batch_id=batch_id, number=attempt_number,
                                                     generation=generation, job_ms=job_ms, now=now, actor=actor)
                if on_row is None:
                    raise AssertionError("the rules decided a commit that the first tries' decision refused")
                return cp.id, _decision_of(on_row), [], None
            if locked.on_row:
                repo.materialize_first_tries(conn, [attempt.id])
            # the decision, the records that came with the commit and the audit event in one statement
            decided_cp, decided_attempt, winners = hot_path.decide(
                conn, sink_id=sink.id, checkpoint_id=cp.id, attempt_id=attempt.id, number=attempt_number,
                partitions=len(results), job_ms=job_ms, records=plan.records,
                now=now, actor=actor,
                event_detail=hot_path.decision_event_detail(batch_id, attempt_number,
                                                            ((w.partition, w.id) for w in plan.winners)),
            )
            winners += [repo.as_lease(r) for r in repo.cas(
                conn, lease_rows, [w.id for w in plan.winners if w.id not in recorded], [LeaseState.PRECOMMITTED],
                LeaseState.COMMITTING)]
            winners.sort(key=lambda x: x.id)
            if len(winners) != len(plan.winners):
                raise AssertionError("a winner changed state under the decision's locks")
            losers = repo.cas(conn, lease_rows, [x.id for x in plan.losers], UNDECIDED_LEASE_STATES, LeaseState.ABORTING)
            # first-try leases of empty partitions: no producer ever used them, free at once
            unused = repo.cas(conn, lease_rows, [x.id for x in plan.unused], [LeaseState.LEASED], LeaseState.ABORTED,
                              resolved_at=now)
            repo.release_transactional_ids(conn, [r.id for r in unused], now)
            decision = _Decision(sink, decided_cp, decided_attempt, winners)
            return cp.id, decision, [repo.as_lease(r) for r in losers], None

        # the common case, first tries on the attempt's row, decided with its locks in one round trip;
        # anything else (nothing written) as above
        common = hot_path.first_tries_commit(results, self.limits.max_partitions)
        at_once = None if common is None else self._tx(lambda conn: hot_path.decide_first_tries(
            conn, common, name=name, batch_id=batch_id, number=attempt_number, generation=generation,
            job_ms=job_ms, now=given_now(self.clock, conn), actor=actor))
        if at_once is not None:
            self._check_rules_agree(at_once, generation, results)
            checkpoint_id, decision, to_abort, refusal = at_once.checkpoint.id, _decision_of(at_once), [], None
        else:
            checkpoint_id, decision, to_abort, refusal = self._tx(step)
        if refusal is not None:
            metrics.checkpoint_outcome(name, "deadline_refused")
            self._abort_on_kafka(name, to_abort)
            raise refusal
        try:
            if decision:
                result = self._commit_winners(decision)
            else:  # a retried commit (its answer lost) finds the decision in the record
                result = self._finish_commit(name, checkpoint_id, "commit_retry")
        finally:
            # losers do not depend on the winners: end their transactions (which would block
            # read_committed consumers) even while the winners' commit waits for Kafka
            self._abort_on_kafka(name, to_abort)
        if result is None or to_abort:  # the answer must show the states the aborts left
            result = self._commit_result(name, batch_id)
        return result

    def _check_rules_agree(self, decided: hot_path.FirstTriesDecided, generation: int,
                           results: Sequence[PartitionResult]) -> None:
        """The rules on the head that the first tries' decision locked: they must decide the same
        (its guard restates them; a disagreement is a bug in that guard, raised, never answered as
        a decision; the commit stays decided, for a retry or the recovery loop to finish)."""
        head = decided.head
        try:
            rules.check_generation(head.sink.generation, generation)
            rules.check_attempt_writable(head.attempt, head.checkpoint.current_attempt, generation)
            plan = rules.plan_commit(head.first_tries or (), results, self.limits.max_partitions)
            rules.check_commit_deadlines(plan.winners, head.db_now, head.sink.commit_margin_ms)
        except e.ProtocolError as refusal:
            raise AssertionError(f"the first tries' decision let through a commit the rules refuse: {refusal}") \
                from refusal
        if plan.losers or [w.id for w in plan.winners] != [w.id for w in decided.winners] or \
                [x.id for x in plan.unused] != [x.id for x in decided.unused]:
            raise AssertionError("the first tries' decision chose other winners than the rules")

    def resume(self, name: str, batch_id: int) -> CommitResult:
        """Finish a decided commit (after a crash); answers from the record if it is finished."""
        with self.engine.connect() as conn:
            cp = repo.checkpoint_for(conn, repo.sink_by_name(conn, name), batch_id)
        if cp.state is CheckpointState.OPEN:
            raise e.Conflict(e.NOT_COMMITTING, f"batch {batch_id} has no decided commit to resume")
        try:
            self._finish_commit(name, cp.id, "resume")
        finally:
            self._abort_on_kafka(name, self._aborting_leases([cp.id]))
        return self._commit_result(name, batch_id)

    def _commit_result(self, name: str, batch_id: int) -> CommitResult:
        """The answer to commit and resume, read from the record so that a retry (on any replica)
        answers the same."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            cp = repo.checkpoint_for(conn, sink, batch_id)
            if cp.history_pruned_at is not None:
                raise e.Conflict(
                    e.HISTORY_PRUNED, f"batch {batch_id} committed at {cp.committed_at.isoformat()}; its attempts, "  # type: ignore[union-attr]
                    f"leases and events were pruned at {cp.history_pruned_at.isoformat()}, so there is nothing to "
                    "finish and no record to answer from", batch_id=batch_id)
            assert cp.committed_attempt is not None
            attempt = repo.attempt_of(conn, cp.id, cp.committed_attempt)
            return self._result_from(sink, cp, attempt, repo.leases_where(conn, leases.c.checkpoint_id == cp.id))

    def acknowledge_lost_data(
        self, name: str, actor: str, reason: str, operator: str | None = None
    ) -> tuple[Sink, bool, list[int]]:
        """Operator action: clear a sink's lost-data halt. Returns the sink, whether it was halted,
        and the batch ids of the sink's LOST checkpoints (a retried acknowledgement, or one of a
        sink that is not halted, changes nothing and answers False)."""

        def step(conn: Connection) -> tuple[Sink, bool, list[int]]:
            sink = repo.sink_by_name(conn, name, lock="update")
            if sink.halted_at is None:
                return sink, False, []
            lost = conn.execute(
                select(checkpoints.c.batch_id).where(
                    checkpoints.c.sink_id == sink.id, checkpoints.c.state == CheckpointState.LOST.value
                ).order_by(checkpoints.c.batch_id)
            ).scalars().all()
            now = self.clock.now_in(conn)
            conn.execute(update(sinks).where(sinks.c.id == sink.id).values(halted_reason=None, halted_at=None))
            repo.add_event(
                conn, sink.id, "lost_data_acknowledged", actor, now,
                reason=reason, operator=operator, halted_reason=sink.halted_reason,
                halted_at=sink.halted_at.isoformat(), lost_batches=list(lost),
            )
            return repo.sink_by_name(conn, name), True, list(lost)

        sink, was_halted, lost = self._tx(step)
        if was_halted:
            metrics.LOST_DATA_ACKNOWLEDGED.labels(name).inc()
            log.warning("sink %s: lost data acknowledged by %s (%s): %s", name, actor, operator, reason)
        metrics.SINK_HALTED.labels(name).set(0)
        return sink, was_halted, lost

    # --- abort --------------------------------------------------------------------------------

    def abort_attempt(
        self, name: str, batch_id: int, attempt_number: int, generation: int | None, reason: str, actor: str
    ) -> tuple[Attempt, AbortOutcome]:
        """Abort an undecided attempt (the driver gives up on it, or an operator does)."""

        def step(conn: Connection) -> list[Lease] | None:
            sink = repo.sink_by_name(conn, name)
            if generation is not None:
                rules.check_generation(sink.generation, generation)
            cp = repo.checkpoint_for(conn, sink, batch_id, lock=True)
            attempt = repo.attempt_of(conn, cp.id, attempt_number, lock="update")
            if attempt.state is AttemptState.ABORTED:
                return None  # a retry, or aborted earlier for another reason
            if attempt.state is not AttemptState.OPEN:
                raise e.Conflict(e.COMMIT_DECIDED, f"attempt {attempt_number} is {attempt.state}; it can no longer be aborted")
            now = self.clock.now_in(conn)
            return self._abort_attempt_rows(conn, sink, [attempt.id], reason, now, actor)

        to_abort = self._tx(step)
        if to_abort is not None:
            metrics.checkpoint_outcome(name, "aborted")
        self._abort_on_kafka(name, to_abort or [])
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            cp = repo.checkpoint_for(conn, sink, batch_id)
            attempt = repo.attempt_of(conn, cp.id, attempt_number)
            all_leases = repo.leases_where(conn, leases.c.attempt_id == attempt.id)
        return attempt, AbortOutcome(
            aborted=[x.transactional_id for x in all_leases if x.state is LeaseState.ABORTED],
            pending=[x.transactional_id for x in all_leases if x.state is LeaseState.ABORTING],
        )


def _fenced_by(generation: int) -> str:
    return f"fenced_by_generation_{generation}"
