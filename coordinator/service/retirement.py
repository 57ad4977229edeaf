"""Retiring a sink (admin): once nothing of it can be open (protocol/rules.retirement_blockers),
the sink is marked retired. Its row, checkpoints and event trail stay (the audit trail), its name
and transactional id prefix stay reserved, and every later call naming it is answered 409
`sink_retired` (store/repo.sink_by_name). Begin and generation calls lock the sink row as this does,
so no attempt can open between the check and the mark; a lease needs an open attempt."""

from __future__ import annotations

from sqlalchemy import Connection, func, select, update

from ..protocol import errors as e
from ..protocol import rules
from ..protocol.model import Sink
from ..protocol.states import UNRESOLVED_LEASE_STATES, AttemptState, CheckpointState
from ..store import repo
from ..store.tables import attempts, checkpoints, sinks, unresolved_leases
from . import metrics
from .base import CoordinatorBase


class RetirementOperations(CoordinatorBase):
    def retire_sink(self, name: str, actor: str, reason: str) -> tuple[Sink, bool]:
        """Returns (sink, retired now). Retiring a retired sink again answers from the record."""

        def step(conn: Connection) -> tuple[Sink, bool]:
            sink = repo.sink_by_name(conn, name, lock="update", retired=True)
            if sink.retired_at is not None:
                return sink, False

            def count(table, *where) -> int:  # type: ignore[no-untyped-def]
                return int(conn.execute(select(func.count()).select_from(table).where(*where)).scalar_one())

            blockers = rules.retirement_blockers(
                open_attempts=count(attempts, attempts.c.sink_id == sink.id,
                                    attempts.c.state == AttemptState.OPEN.value,
                                    attempts.c.finished_at.is_(None)),  # the partial index ix_attempts_open
                committing_checkpoints=count(checkpoints, checkpoints.c.sink_id == sink.id,
                                             checkpoints.c.state == CheckpointState.COMMITTING.value),
                unresolved_leases=count(unresolved_leases, unresolved_leases.c.sink_id == sink.id,
                                        repo.unresolved_in(*UNRESOLVED_LEASE_STATES)),
            )
            if blockers:
                raise e.Conflict(e.RETIREMENT_BLOCKED, f"sink {name!r} cannot be retired yet: " + "; ".join(blockers),
                                 blockers=blockers)
            now = self.clock.now()
            conn.execute(update(sinks).where(sinks.c.id == sink.id).values(retired_at=now))
            repo.add_event(conn, sink.id, "sink_retired", actor, now, reason=reason)
            return repo.sink_by_name(conn, name, retired=True), True

        retired = self._tx(step)
        metrics.forget_sink(name)  # its halt and other last-seen gauges would stay as they were
        return retired
