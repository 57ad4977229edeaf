"""What a schedule checks: the invariants on the database after every driver run (I1-I4, F1, F2,
L1, R1, and I1's history half), I5 on every stale call, and at the end I6 (nothing left open on
the broker) and I7 (every record of every batch Spark committed visible exactly once), that lost
data is declared only when true, and liveness."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from coordinator.protocol import recovery_rules
from coordinator.protocol.invariants import (
    Snapshot,
    check_committed_unchanged,
    check_invariants,
    check_no_quick_reuse,
)
from coordinator.protocol.states import CheckpointState
from coordinator.store.snapshot import snapshot


class ScheduleChecks:
    """A mixin of runner.Sim: the checks on the schedule's state."""

    def sink_snapshot(self) -> Snapshot:
        """The durable state of the schedule's own sink (other schedules may share the database)."""
        with self.engine.connect() as conn:
            whole = snapshot(conn)
        sid = self.sink_id
        return Snapshot(
            sinks=[x for x in whole.sinks if x.id == sid],
            checkpoints=[x for x in whole.checkpoints if x.sink_id == sid],
            attempts=[x for x in whole.attempts if x.checkpoint_id in {c.id for c in whole.checkpoints if c.sink_id == sid}],
            leases=[x for x in whole.leases if x.sink_id == sid],
            quarantines=[x for x in whole.quarantines if x.sink_id == sid],
            alerts=[x for x in whole.alerts if x.sink_id == sid],
        )

    def check_db(self, *, settled: bool, when: str) -> None:
        snap = self.sink_snapshot()
        found = check_invariants(snap, settled=settled)
        found += check_no_quick_reuse(snap, timedelta(milliseconds=self.executor_init_reach_ms(self.limits)))
        if self.last_snapshot is not None:
            found += check_committed_unchanged(self.last_snapshot, snap)
        self.last_snapshot = snap
        self.violations += [f"{v} [{when}]" for v in map(str, found)]

    def check_unexplained_open(self) -> None:
        """I6 while transactions can still be open: every one under the prefix is one an unresolved
        lease explains."""
        unexplained = recovery_rules.lingering(self.model.list_open(self.prefix + "-"), self.sink_snapshot().leases,
                                               include_completing=True)
        if unexplained:
            self.violations.append("I6: open transactions no unresolved lease explains after recovery: "
                                   f"{[self.local(t.transactional_id) for t in unexplained]}")

    def check_end(self) -> None:
        # I1-I4, F1, F2 and L1 on the settled database; I1's history half against the earlier snapshots
        self.check_db(settled=True, when="after quiescence")
        # I6: nothing left open under the sink's prefix
        still_open = self.model.list_open(self.prefix + "-")
        if still_open:
            self.violations.append(f"I6: open transactions after recovery: {[self.local(t.transactional_id) for t in still_open]}")
        # I7: the read_committed view holds exactly the records of Spark's committed batches
        visible = Counter(self.model.read_committed(self.topic))
        expected = Counter(r for b in sorted(self.ckpt.commits) for r in self.ckpt.offsets[b])
        dup = sorted(r for r, n in visible.items() if n > 1)
        missing = sorted(set(expected) - set(visible))
        extra = sorted(set(visible) - set(expected))
        if dup:
            self.violations.append(f"I7: records visible more than once: {dup[:10]}")
        if missing:
            self.violations.append(f"I7: records of committed batches not visible: {missing[:10]}")
        if extra:
            self.violations.append(f"I7: records of uncommitted batches visible: {extra[:10]}")
        # loss is declared only when true, and in a correctly configured deployment never happens
        for cp in self.sink_snapshot().checkpoints:
            if cp.state is CheckpointState.LOST:
                planned = self.ckpt.offsets.get(cp.batch_id, [])
                false = planned and all(visible[r] for r in planned)
                self.violations.append(f"{'FALSE LOST' if false else 'LOST'}: batch {cp.batch_id}: {cp.lost_reason}")
        if len(self.ckpt.commits) < self.n_batches:
            self.violations.append(f"LIVENESS: only {sorted(self.ckpt.commits)} of {self.n_batches} batches committed "
                                  "after the final fault-free restart")
        self.trace(f"end: spark committed {sorted(self.ckpt.commits)}, {sum(visible.values())} records visible")
