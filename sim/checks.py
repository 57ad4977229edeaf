"""What a schedule checks: the invariants on the database after every driver run (I1-I4, F1, F2,
L1, R1, and I1's history half), I5 on every stale call, and at the end I6 (nothing left open on
the broker) and I7 (every record of every batch Spark committed visible exactly once), that lost
data is declared only when true, and liveness."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import TYPE_CHECKING

from coordinator.protocol import recovery_rules
from coordinator.protocol.invariants import (
    Snapshot,
    check_committed_unchanged,
    check_invariants,
    check_no_quick_reuse,
)
from coordinator.protocol.states import CheckpointState
from coordinator.store.snapshot import snapshot

if TYPE_CHECKING:
    from .runner import Sim


def sink_snapshot(sim: Sim) -> Snapshot:
    """The durable state of the schedule's own sink (other schedules may share the database)."""
    with sim.engine.connect() as conn:
        whole = snapshot(conn)
    sid = sim.sink_id
    return Snapshot(
        sinks=[x for x in whole.sinks if x.id == sid],
        checkpoints=[x for x in whole.checkpoints if x.sink_id == sid],
        attempts=[x for x in whole.attempts if x.checkpoint_id in {c.id for c in whole.checkpoints if c.sink_id == sid}],
        leases=[x for x in whole.leases if x.sink_id == sid],
        quarantines=[x for x in whole.quarantines if x.sink_id == sid],
        alerts=[x for x in whole.alerts if x.sink_id == sid],
    )


def check_db(sim: Sim, *, settled: bool, when: str) -> None:
    snap = sink_snapshot(sim)
    found = check_invariants(snap, settled=settled)
    found += check_no_quick_reuse(snap, timedelta(milliseconds=sim.executor_init_reach_ms(sim.limits)))
    if sim.last_snapshot is not None:
        found += check_committed_unchanged(sim.last_snapshot, snap)
    sim.last_snapshot = snap
    sim.violations += [f"{v} [{when}]" for v in map(str, found)]


def check_unexplained_open(sim: Sim) -> None:
    """I6 while transactions can still be open: every one under the prefix is one an unresolved
    lease explains."""
    unexplained = recovery_rules.lingering(sim.model.list_open(sim.prefix + "-"), sink_snapshot(sim).leases,
                                           include_completing=True)
    if unexplained:
        sim.violations.append("I6: open transactions no unresolved lease explains after recovery: "
                              f"{[sim.local(t.transactional_id) for t in unexplained]}")


def check_end(sim: Sim) -> None:
    # I1-I4, F1, F2 and L1 on the settled database; I1's history half against the earlier snapshots
    check_db(sim, settled=True, when="after quiescence")
    # I6: nothing left open under the sink's prefix
    still_open = sim.model.list_open(sim.prefix + "-")
    if still_open:
        sim.violations.append(f"I6: open transactions after recovery: {[sim.local(t.transactional_id) for t in still_open]}")
    # I7: the read_committed view holds exactly the records of Spark's committed batches
    visible = Counter(sim.model.read_committed(sim.topic))
    expected = Counter(r for b in sorted(sim.ckpt.commits) for r in sim.ckpt.offsets[b])
    dup = sorted(r for r, n in visible.items() if n > 1)
    missing = sorted(set(expected) - set(visible))
    extra = sorted(set(visible) - set(expected))
    if dup:
        sim.violations.append(f"I7: records visible more than once: {dup[:10]}")
    if missing:
        sim.violations.append(f"I7: records of committed batches not visible: {missing[:10]}")
    if extra:
        sim.violations.append(f"I7: records of uncommitted batches visible: {extra[:10]}")
    # loss is declared only when true, and in a correctly configured deployment never happens
    for cp in sink_snapshot(sim).checkpoints:
        if cp.state is CheckpointState.LOST:
            planned = sim.ckpt.offsets.get(cp.batch_id, [])
            false = planned and all(visible[r] for r in planned)
            sim.violations.append(f"{'FALSE LOST' if false else 'LOST'}: batch {cp.batch_id}: {cp.lost_reason}")
    if len(sim.ckpt.commits) < sim.n_batches:
        sim.violations.append(f"LIVENESS: only {sorted(sim.ckpt.commits)} of {sim.n_batches} batches committed "
                              "after the final fault-free restart")
    sim.trace(f"end: spark committed {sorted(sim.ckpt.commits)}, {sum(visible.values())} records visible")
