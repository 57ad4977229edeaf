"""The broker observations run against a registered sink through the coordinator (DESIGN.md §3
step 6, issue 3): the thin glue between the HTTP API, the dashboard and the recovery loop on one
side and the control plane's observations and their interpretation (coordinator/kafka/broker.py)
on the other.

`check_sink_broker`
    `check_broker` with the sink's settings and its pool ids as the ids the coordinator knows.
`observe_partitions`
    `partition_stability` compared with the previous observation kept in-process per sink by a
    `PartitionWatch`, and who holds the stuck partitions.
`lingering_transactions`
    The open transactions under the sink's prefix that no unresolved lease explains (read only).
`record_lso_lag`
    The last-stable-offset lag gauges, set by the recovery loop for the sinks it has work for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..kafka.broker import BlockingTransaction, PartitionWatch, StuckPartition, name_blocking_transactions
from ..kafka.control_plane import (
    BrokerCheck,
    ControlPlaneError,
    KafkaControlPlane,
    KafkaTarget,
    OpenTransaction,
    PartitionStability,
)
from ..protocol import errors as e
from ..protocol import recovery_rules
from ..protocol.configuration import transactional_id_for, transactional_id_stem
from ..protocol.model import Sink
from ..store import leases, pool
from . import metrics

if TYPE_CHECKING:
    from . import Coordinator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionReport:
    partitions: list[PartitionStability]
    stuck: list[StuckPartition]
    blocking: list[BlockingTransaction]
    notes: list[str]


def _plane_and_target(coordinator: Coordinator, name: str) -> tuple[KafkaControlPlane, KafkaTarget, Sink]:
    sink = coordinator.get_sink(name)  # 404 for an unknown sink, before anything else
    if coordinator.control_plane is None:
        raise e.Unavailable(
            e.NO_CONTROL_PLANE,
            "the coordinator has no Kafka control plane configured (COORDINATOR_KAFKA_CONTROL_PLANE), so it cannot "
            "observe the broker",
        )
    return coordinator.control_plane, KafkaTarget(sink.name, sink.bootstrap_servers, sink.transaction_timeout_ms), sink


def known_transactional_ids(coordinator: Coordinator, sink: Sink) -> set[str]:
    """Every transactional id of the sink's pool: the ids the coordinator created under its prefix."""
    size = coordinator.ctx.read(lambda conn: pool.read(conn, sink.id)).size
    return {transactional_id_for(sink.transactional_id_prefix, n) for n in range(size)}


def check_sink_broker(coordinator: Coordinator, name: str) -> list[BrokerCheck]:
    """`check_broker` for a registered sink: its bootstrap servers, transaction timeout and id
    prefix ("<prefix>-", as the pool names ids), with the sink's pool ids as the ids the
    coordinator knows. 503 without a control plane."""
    plane, target, sink = _plane_and_target(coordinator, name)
    known = known_transactional_ids(coordinator, sink)
    # pool ids are "<stem><ordinal>" (transactional_id_for): only ids under the stem can collide
    return plane.check_broker(target, transactional_id_stem(sink.transactional_id_prefix), known)


def lingering_transactions(coordinator: Coordinator, name: str) -> list[OpenTransaction]:
    """The open transactions under the sink's prefix that no unresolved lease explains, read only
    (the dashboard shows them; the recovery loop's `Coordinator.sweep_lingering` aborts them)."""
    plane, target, sink = _plane_and_target(coordinator, name)
    listed = plane.list_open_transactions(target, transactional_id_stem(sink.transactional_id_prefix))
    return recovery_rules.lingering(listed, coordinator.possibly_open_transactions(name)) if listed else []


def observe_partitions(coordinator: Coordinator, name: str, watch: PartitionWatch, *, min_stall_s: float) -> PartitionReport:
    """High watermark and last stable offset of every partition of the sink's topics, which of them
    are stuck (compared with the previous observation this process made), and who holds them.
    A broker failure is a 503 naming it."""
    plane, target, sink = _plane_and_target(coordinator, name)
    topics = list(sink.topics)
    try:
        current = plane.partition_stability(target, topics)
    except ControlPlaneError as exc:
        raise e.Unavailable("kafka_unavailable", f"could not observe the sink's partitions: {exc}", code=exc.code) from exc
    metrics.partitions_observed(name, current)
    stuck = watch.observe(name, current, min_stall_s=min_stall_s)
    notes = []
    if not topics:
        notes.append("the sink was registered without topics: nothing to observe")
    if stuck:
        pids = sorted({s.blocking_producer_id for s in stuck if s.blocking_producer_id is not None})
        related = coordinator.ctx.read(lambda conn: [*leases.of_producers(conn, sink.id, pids),
                                                     *leases.unresolved(conn, sink.id)]) if pids else []
        try:  # producer id -> transactional id, for a try whose record has not come yet
            listed = plane.list_open_transactions(target, transactional_id_stem(sink.transactional_id_prefix)) \
                if pids else []
        except ControlPlaneError as exc:
            listed = []
            notes.append(f"the broker's open transactions could not be listed ({exc.code})")
        blocking = name_blocking_transactions(stuck, related, listed)
        if any(s.blocking_producer_id is None for s in stuck):
            notes.append("the broker did not name the producer holding some partitions (DescribeProducers, KIP-664, "
                         "Kafka >= 3.0, unsupported or refused)")
    else:
        blocking = []
    return PartitionReport(current, stuck, blocking, notes)


def record_lso_lag(coordinator: Coordinator, name: str) -> None:
    """Observe the sink's partitions and set their last-stable-offset lag gauges (the recovery
    loop calls this for each sink it has work for). Best effort: a failure is logged, never raised."""
    try:
        plane, target, sink = _plane_and_target(coordinator, name)
        metrics.partitions_observed(name, plane.partition_stability(target, list(sink.topics)))
    except Exception as exc:  # noqa: BLE001 - the gauge is an observation, not a step of recovery
        log.debug("could not observe the partitions of sink %s for the lag gauge: %s", name, exc)
