"""Broker observations for operators (coordinator/kafka/broker.py): a check of the sink's Kafka
cluster now, and its partitions' stable offsets with what holds them."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Query, Request

from ...service.broker_checks import check_sink_broker, observe_partitions
from ..broker_schemas import BrokerCheckOut, PartitionsOut
from ..dependencies import Admin, Service
from ..input import InputRoute, SinkName, error_responses

router = APIRouter(route_class=InputRoute, tags=["operator"], responses=error_responses(401, 403, 404, 409, 503))


@router.post("/v1/sinks/{name}/broker-check")
def broker_check(name: SinkName, _: Admin, coordinator: Service) -> list[BrokerCheckOut]:
    """Check the sink's Kafka cluster now: bootstrap and advertised listeners reachable,
    transactions supported, transaction.max.timeout.ms against the sink's timeout, no unknown
    producer under the prefix, authorization. Each verdict in plain words with its fix."""
    return [BrokerCheckOut(**asdict(c)) for c in check_sink_broker(coordinator, name)]


@router.get("/v1/sinks/{name}/partitions")
def partitions(name: SinkName, _: Admin, coordinator: Service, request: Request,
               min_stall_s: Annotated[float, Query(ge=0, le=86_400)] = 60.0) -> PartitionsOut:
    """High watermark and last stable offset of every partition of the sink's topics; `stuck`
    when the stable offset stayed below the high watermark for at least min_stall_s since an
    earlier call (to this process), with the transaction holding it."""
    return PartitionsOut.of(observe_partitions(coordinator, name, request.app.state.partition_watch,
                                               min_stall_s=min_stall_s))
