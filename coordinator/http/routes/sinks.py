"""Sinks: registration, listing, writer tokens, retirement, lost data, lineage, and pruning the
history (admin)."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Response

from ...protocol.model import Sink
from ...service import SinkSpec
from ..auth import writer_token
from ..dependencies import Admin, Service, TokenKeeper, Writer
from ..input import InputRoute, SinkName, error_responses
from ..schemas import (
    HistoryPrune,
    HistoryPruned,
    LineageReset,
    LostDataAcknowledged,
    LostDataAcknowledgement,
    SinkOut,
    SinkRegistered,
    SinkRegistration,
    SinkRetirement,
)

ADMIN_ONLY = error_responses(401, 403, 503)
ON_SINK = error_responses(401, 403, 404, 409, 503)  # 409: sink_retired (a retired sink takes no calls)

router = APIRouter(route_class=InputRoute, tags=["sinks"])


def _registered(sink: Sink, tokens: TokenKeeper) -> SinkRegistered:
    return SinkRegistered(sink=SinkOut.of(sink), writer_token=writer_token(tokens.secret, sink.id,
                                                                            sink.writer_token_version))


@router.post("/v1/sinks", status_code=201, responses={
    200: {"model": SinkRegistered, "description": "the same configuration was registered before (a retry): "
          "the same sink and writer token"},
    **error_responses(401, 403, 409, 503),
})
def register_sink(body: SinkRegistration, who: Admin, coordinator: Service, tokens: TokenKeeper,
                  response: Response) -> SinkRegistered:
    """Register a sink (201). Registering the same configuration again returns the same sink and
    writer token (200); a different configuration under the same name is a 409."""
    spec = SinkSpec(**body.model_dump(exclude={"check_broker"}))
    sink, created = coordinator.register_sink(spec, who.actor, check_broker=body.check_broker)
    if not created:
        response.status_code = 200
    answer = _registered(sink, tokens)
    if not body.check_broker or coordinator.control_plane is None:  # a retry gets the same answer
        answer.warnings.append(
            f"the broker {spec.bootstrap_servers} was not checked ("
            + ("check_broker=false" if not body.check_broker else "no Kafka control plane") + "): "
            f"check it before the first batch with POST /v1/sinks/{spec.name}/broker-check or "
            f"`coordinator doctor --sink {spec.name}`")
    return answer


@router.get("/v1/sinks", responses=ADMIN_ONLY)
def list_sinks(_: Admin, coordinator: Service) -> list[SinkOut]:
    return [SinkOut.of(s) for s in coordinator.list_sinks()]


@router.get("/v1/sinks/{name}", responses=ON_SINK)
def describe_sink(name: SinkName, _: Writer, coordinator: Service) -> SinkOut:
    return SinkOut.of(coordinator.get_sink(name))


@router.post("/v1/sinks/{name}/writer-token", responses=ON_SINK)
def rotate_writer_token(name: SinkName, who: Admin, coordinator: Service, tokens: TokenKeeper) -> SinkRegistered:
    """Issue a new writer token for the sink; the old one stops working."""
    sink = coordinator.rotate_writer_token(name, who.actor)
    tokens.forget(name)
    return _registered(sink, tokens)


@router.post("/v1/sinks/{name}/retire", responses=ON_SINK)
def retire_sink(name: SinkName, body: SinkRetirement, who: Admin, coordinator: Service,
                tokens: TokenKeeper) -> SinkOut:
    """Retire a sink that holds nothing open (no undecided attempt, no unfinished commit, no id
    that may hold a transaction; otherwise 409 sink_has_open_transactions naming what). Its
    records and event trail stay, its name and prefix stay reserved; every later call naming it
    is answered 409 sink_retired. Retiring it again answers the same."""
    sink, _ = coordinator.retire_sink(name, who.actor, body.reason)
    tokens.forget(name)
    return SinkOut.of(sink)


@router.post("/v1/sinks/{name}/lineage/reset", tags=["operator"], responses=ON_SINK)
def reset_lineage(name: SinkName, body: LineageReset, who: Admin, coordinator: Service) -> SinkOut:
    """Let a query started from a fresh checkpoint location take over this sink."""
    return SinkOut.of(coordinator.reset_lineage(name, who.actor, body.reason))


@router.post("/v1/sinks/{name}/lost-data/acknowledge", tags=["operator"], responses=ON_SINK)
def acknowledge_lost_data(name: SinkName, body: LostDataAcknowledgement, who: Admin,
                          coordinator: Service) -> LostDataAcknowledged:
    """Clear the halt a lost commit put on the sink (its `data_lost` events say which batch and
    partitions). Recorded with who and when in the event trail; the LOST batches are then
    skipped when Spark replays them. Acknowledging a sink that is not halted changes nothing."""
    sink, acknowledged, lost = coordinator.acknowledge_lost_data(name, who.actor, body.reason, body.operator)
    return LostDataAcknowledged(sink=SinkOut.of(sink), acknowledged=acknowledged, lost_batches=lost)


@router.post("/v1/history/prune", tags=["operator"], responses=error_responses(401, 403, 404, 503))
def prune_history(body: HistoryPrune, who: Admin, coordinator: Service) -> HistoryPruned:
    """Delete the attempts, leases and events of up to `limit` COMMITTED batches committed more
    than `older_than_s` ago, in one transaction; call again while `more`. Each query's newest
    committed batch, every batch not COMMITTED and every batch with an abort still pending are
    kept whole, and every checkpoint row stays (marked `history_pruned_at`): a replay of a
    pruned batch is skipped as committed, as before."""
    outcome = coordinator.prune_history(timedelta(seconds=body.older_than_s), who.actor, sink=body.sink,
                                        limit=body.limit, dry_run=body.dry_run)
    return HistoryPruned(**outcome.to_dict())
