"""REST API v1: a thin HTTP adapter over `Coordinator`. Authentication, input validation and the
mapping of protocol errors to status codes live here; decisions do not."""


import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from datetime import timedelta
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..service import metrics
from .api_docs import mount_docs
from .auth import Principal, tokens_equal, writer_token
from .broker_schemas import BrokerCheckOut, PartitionsOut
from ..kafka.broker import PartitionWatch
from .dashboard import create_dashboard
from .fast_lane import FastLane, calls_on_loop_for
from .input import (
    AfterLeaseId,
    AttemptNumber,
    BatchId,
    ErrorOut,
    EventId,
    InputRoute,
    LeaseId,
    PageSize,
    SinkName,
    body_limit,
    error_responses,
    install_error_handlers,
)
from .metrics import HttpMetricsMiddleware
from ..protocol import errors as e
from ..protocol.model import Sink
from ..protocol.rules import PrecommitRequest
from ..protocol.states import CheckpointState, LeaseState
from .schemas import (
    AbortOut,
    AbortRequest,
    BeginCheckpointRequest,
    BeginOut,
    CheckpointDetailOut,
    CheckpointOut,
    CommitOut,
    CommitRequest,
    EventOut,
    GenerationOut,
    GenerationRequest,
    HistoryPrune,
    HistoryPruned,
    LeaseGranted,
    LeaseOut,
    LeaseRequest,
    LineageReset,
    LostDataAcknowledged,
    LostDataAcknowledgement,
    PrecommitBody,
    SinkOut,
    SinkRegistered,
    SinkRegistration,
    SinkRetirement,
)
from ..service import Coordinator, SinkSpec
from ..service.broker_checks import check_sink_broker, observe_partitions
from ..store.db import schema_is_current

log = logging.getLogger(__name__)

# The error statuses each kind of route can answer (413/415/422 are added by InputRoute; 503 is a
# database that does not answer, or, for the protocol, no Kafka control plane or an exhausted pool)
ADMIN_ONLY = error_responses(401, 403, 503)
ON_SINK = error_responses(401, 403, 404, 409, 503)  # 409: sink_retired (a retired sink takes no calls)
PROTOCOL = error_responses(401, 403, 404, 409, 503)

bearer_scheme = HTTPBearer(
    auto_error=False, description="the admin token, or a sink's writer token for that sink's protocol calls and reads"
)


class _SinkTokenCache:
    """name -> (sink id, its current writer token), kept a few seconds so a protocol call
    authenticates without a database round trip or an HMAC. Rotation in this process invalidates at
    once; in others after ttl."""

    def __init__(self, token_secret: bytes, ttl_s: float = 5.0) -> None:
        self.token_secret = token_secret
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[float, int, str]] = {}

    def fresh(self, name: str) -> tuple[int, str] | None:
        """The cached entry if it is fresh (no I/O: called on the event loop)."""
        hit = self._entries.get(name)
        if hit is not None and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1], hit[2]
        return None

    def get(self, name: str, load: Callable[[str], Sink]) -> tuple[int, str]:
        hit = self.fresh(name)
        if hit is not None:
            return hit
        sink = load(name)
        token = writer_token(self.token_secret, sink.id, sink.writer_token_version)
        self._entries[name] = (time.monotonic(), sink.id, token)
        return sink.id, token

    def forget(self, name: str) -> None:
        self._entries.pop(name, None)


def _json(model: BaseModel, status_code: int = 200) -> Response:
    """The answer as FastAPI would serialise it for the route's response_model (pydantic's JSON,
    by alias), built in the handler: FastAPI then neither re-validates the value nor hands its
    serialisation to the thread pool a second time (the hot protocol routes)."""
    return Response(model.model_dump_json(by_alias=True), status_code=status_code, media_type="application/json")


def _answer(fields: dict[str, Any]) -> Response:
    """A hot protocol answer from its model's fields as plain values (`answers.answer_fields`):
    the JSON `_json` would send for the validated model, without building the model."""
    return Response(to_json(fields), media_type="application/json")


def create_app(
    coordinator: Coordinator,
    *,
    admin_token: str,
    token_secret: bytes,
    dashboard_viewer_token: str | None = None,
    dashboard_secure_cookie: bool = False,
    fast_lane: bool = True,
    calls_on_loop: bool = True,
) -> FastAPI:
    """The API. `fast_lane`: begin and commit's common case answered by `FastLane` (fast_lane.py);
    off, FastAPI answers every call (the answers are the same). `calls_on_loop`: the lane runs
    its calls on the event loop (`coordinator.on_loop`), else each in a thread."""
    app = FastAPI(
        title="Spark -> Kafka exactly-once transaction coordinator",
        version=__version__,
        description="Two-phase commit of Kafka transactions tied to Spark micro-batches. "
        "Authenticate with `Authorization: Bearer <token>`: the admin token for sink management "
        "and operator actions, a sink's writer token for its protocol calls.",
        docs_url=None,
        redoc_url=None,
    )
    app.router.route_class = InputRoute
    mount_docs(app)  # /docs and /redoc from the package's assets, not a CDN
    app.state.coordinator = coordinator
    app.state.body_limit = body_limit(coordinator.limits.max_partitions)  # the widest commit fits
    database_metrics = metrics.database_registry(coordinator.engine)
    cache = _SinkTokenCache(token_secret)

    # --- errors ------------------------------------------------------------------------------

    def count_fenced(exc: e.ProtocolError) -> None:
        if exc.status == 409:
            metrics.request_fenced(exc.reason)

    install_error_handlers(app, on_protocol_error=count_fenced)

    # --- authentication ----------------------------------------------------------------------

    # async: no I/O on the event loop except a cache miss, which goes to the thread pool (a sync
    # dependency would cost a thread-pool hand-off per call each)
    async def bearer(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]) -> str:
        if credentials is None:
            raise _Unauthorized()
        return credentials.credentials.strip()

    async def admin(token: Annotated[str, Depends(bearer)]) -> Principal:
        if not tokens_equal(token, admin_token):
            raise _Forbidden("this action needs the admin token")
        return Principal(is_admin=True)

    def known_writer(name: str, token: str) -> Principal | None:
        """`writer`'s answer when it needs no I/O: the admin token, or the sink's token in a fresh
        cache entry; None otherwise."""
        if tokens_equal(token, admin_token):
            return Principal(is_admin=True)
        hit = cache.fresh(name)
        if hit is not None and tokens_equal(token, hit[1]):
            return Principal(is_admin=False, sink_name=name)
        return None

    async def writer(name: SinkName, token: Annotated[str, Depends(bearer)]) -> Principal:
        """The sink's writer token, or the admin token. Without the admin token, an unknown sink
        and another sink's are refused alike: the answer does not tell which names exist."""
        who = known_writer(name, token)
        if who is not None:
            return who
        not_yours = _Forbidden("the token is neither the admin token nor this sink's writer token")
        hit = cache.fresh(name)
        if hit is None:
            try:
                hit = await run_in_threadpool(cache.get, name, coordinator.get_sink)
            except e.NotFound:
                raise not_yours from None
        if not tokens_equal(token, hit[1]):
            raise not_yours
        return Principal(is_admin=False, sink_name=name)

    async def writer_without_io(request: Request, name: str) -> Principal | None:
        """For the fast lane: `writer`'s answer from the request's bearer token if it needs no I/O."""
        credentials = await bearer_scheme(request)
        return None if credentials is None else known_writer(name, await bearer(credentials))

    Admin = Annotated[Principal, Depends(admin)]
    Writer = Annotated[Principal, Depends(writer)]

    # --- health ------------------------------------------------------------------------------

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"model": ErrorOut, "description": "not ready (error.reason says why)"}})
    def readyz() -> JSONResponse:
        """Readiness: the database answers and its schema is at the current migration."""
        try:
            current = schema_is_current(coordinator.engine)
        except Exception as exc:  # any database failure means not ready
            return JSONResponse(status_code=503, content={"error": {"reason": "database_unavailable", "message": str(exc)}})
        if not current:
            return JSONResponse(
                status_code=503,
                content={"error": {"reason": "schema_not_current", "message": "run `coordinator migrate`"}},
            )
        plane = coordinator.control_plane.name if coordinator.control_plane else "unconfigured"
        return JSONResponse({"status": "ready", "kafka_control_plane": plane})

    @app.get("/metrics", tags=["health"], response_class=Response)
    def prometheus_metrics() -> Response:
        """Prometheus metrics of this process and of the database's state (coordinator/service/metrics.py)."""
        body, content_type = metrics.render(database_metrics)
        return Response(content=body, media_type=content_type)

    # --- sinks -------------------------------------------------------------------------------

    def registered(sink: Sink) -> SinkRegistered:
        return SinkRegistered(sink=SinkOut.of(sink), writer_token=writer_token(token_secret, sink.id, sink.writer_token_version))

    @app.post("/v1/sinks", status_code=201, tags=["sinks"], responses={
        200: {"model": SinkRegistered, "description": "the same configuration was registered before (a retry): "
              "the same sink and writer token"},
        **error_responses(401, 403, 409, 503),
    })
    def register_sink(body: SinkRegistration, who: Admin, response: Response) -> SinkRegistered:
        """Register a sink (201). Registering the same configuration again returns the same sink and
        writer token (200); a different configuration under the same name is a 409."""
        spec = SinkSpec(**body.model_dump(exclude={"check_broker"}))
        sink, created = coordinator.register_sink(spec, who.actor, check_broker=body.check_broker)
        if not created:
            response.status_code = 200
        answer = registered(sink)
        if not body.check_broker or coordinator.control_plane is None:  # a retry gets the same answer
            answer.warnings.append(
                f"the broker {spec.bootstrap_servers} was not checked ("
                + ("check_broker=false" if not body.check_broker else "no Kafka control plane") + "): "
                f"check it before the first batch with POST /v1/sinks/{spec.name}/broker-check or "
                f"`coordinator doctor --sink {spec.name}`")
        return answer

    @app.get("/v1/sinks", tags=["sinks"], responses=ADMIN_ONLY)
    def list_sinks(_: Admin) -> list[SinkOut]:
        return [SinkOut.of(s) for s in coordinator.list_sinks()]

    @app.get("/v1/sinks/{name}", tags=["sinks"], responses=ON_SINK)
    def describe_sink(name: SinkName, _: Writer) -> SinkOut:
        return SinkOut.of(coordinator.get_sink(name))

    @app.post("/v1/sinks/{name}/writer-token", tags=["sinks"], responses=ON_SINK)
    def rotate_writer_token(name: SinkName, who: Admin) -> SinkRegistered:
        """Issue a new writer token for the sink; the old one stops working."""
        sink = coordinator.rotate_writer_token(name, who.actor)
        cache.forget(name)
        return registered(sink)

    @app.post("/v1/sinks/{name}/generations", tags=["protocol"], responses=PROTOCOL, response_model=GenerationOut)
    def start_generation(name: SinkName, body: GenerationRequest, who: Writer) -> Response:
        """A Spark query (re)started: returns a new generation that fences every older driver."""
        gen, aborts = coordinator.start_generation(name, body.query_id, body.run_id, who.actor)
        return _json(GenerationOut(generation=gen, aborted=aborts.aborted, abort_pending=aborts.pending))

    @app.post("/v1/sinks/{name}/lineage/reset", tags=["operator"], responses=PROTOCOL)
    def reset_lineage(name: SinkName, body: LineageReset, who: Admin) -> SinkOut:
        """Let a query started from a fresh checkpoint location take over this sink."""
        return SinkOut.of(coordinator.reset_lineage(name, who.actor, body.reason))

    @app.post("/v1/sinks/{name}/retire", tags=["sinks"], responses=PROTOCOL)
    def retire_sink(name: SinkName, body: SinkRetirement, who: Admin) -> SinkOut:
        """Retire a sink that holds nothing open (no undecided attempt, no unfinished commit, no id
        that may hold a transaction; otherwise 409 sink_has_open_transactions naming what). Its
        records and event trail stay, its name and prefix stay reserved; every later call naming it
        is answered 409 sink_retired. Retiring it again answers the same."""
        sink, _ = coordinator.retire_sink(name, who.actor, body.reason)
        cache.forget(name)
        return SinkOut.of(sink)

    @app.post("/v1/sinks/{name}/lost-data/acknowledge", tags=["operator"], responses=PROTOCOL)
    def acknowledge_lost_data(name: SinkName, body: LostDataAcknowledgement, who: Admin) -> LostDataAcknowledged:
        """Clear the halt a lost commit put on the sink (its `data_lost` events say which batch and
        partitions). Recorded with who and when in the event trail; the LOST batches are then
        skipped when Spark replays them. Acknowledging a sink that is not halted changes nothing."""
        sink, acknowledged, lost = coordinator.acknowledge_lost_data(name, who.actor, body.reason, body.operator)
        return LostDataAcknowledged(sink=SinkOut.of(sink), acknowledged=acknowledged, lost_batches=lost)

    @app.post("/v1/history/prune", tags=["operator"], responses=error_responses(401, 403, 404, 503))
    def prune_history(body: HistoryPrune, who: Admin) -> HistoryPruned:
        """Delete the attempts, leases and events of up to `limit` COMMITTED batches committed more
        than `older_than_s` ago, in one transaction; call again while `more`. Each query's newest
        committed batch, every batch not COMMITTED and every batch with an abort still pending are
        kept whole, and every checkpoint row stays (marked `history_pruned_at`): a replay of a
        pruned batch is skipped as committed, as before."""
        outcome = coordinator.prune_history(timedelta(seconds=body.older_than_s), who.actor, sink=body.sink,
                                            limit=body.limit, dry_run=body.dry_run)
        return HistoryPruned(**outcome.to_dict())

    # --- checkpoints -------------------------------------------------------------------------
    # The protocol routes answer a ready Response (see _json, _answer) with the model named in the decorator.

    @app.post("/v1/sinks/{name}/checkpoints/{batch_id}/begin", tags=["protocol"], responses=PROTOCOL,
              response_model=BeginOut)
    def begin_checkpoint(name: SinkName, batch_id: BatchId, body: BeginCheckpointRequest, who: Writer) -> Response:
        return _answer(BeginOut.fields_of(coordinator.begin_checkpoint(
            name, batch_id, body.generation, who.actor, partitions=body.partitions, offsets_digest=body.offsets)))

    @app.post(
        "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/leases", tags=["protocol"], responses=PROTOCOL,
        response_model=LeaseGranted,
    )
    def begin_partition(
        name: SinkName, batch_id: BatchId, attempt: AttemptNumber, body: LeaseRequest, _: Writer
    ) -> Response:
        lease = coordinator.begin_partition(name, batch_id, attempt, body.generation, body.partition, body.task_attempt_id)
        out = LeaseOut.of(lease, attempt)
        timeout_ms = int((lease.deadline_at - lease.leased_at).total_seconds() * 1000)
        age_ms = max(0, int((coordinator.clock.now() - lease.leased_at).total_seconds() * 1000))  # the database's clock
        return _json(LeaseGranted(**out.model_dump(), transaction_timeout_ms=timeout_ms, age_ms=age_ms,
                                  max_lease_init_age_ms=coordinator.limits.lease_max_init_age_ms))

    @app.post("/v1/sinks/{name}/leases/{lease_id}/precommit", tags=["protocol"], responses=PROTOCOL,
              response_model=LeaseOut)
    def precommit(name: SinkName, lease_id: LeaseId, body: PrecommitBody, _: Writer) -> Response:
        req = PrecommitRequest(body.producer_id, body.producer_epoch, body.records, body.bytes, body.write_ms)
        return _json(LeaseOut.of(coordinator.precommit(name, lease_id, body.generation, req)))

    @app.post(
        "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/commit", tags=["protocol"], responses=PROTOCOL,
        response_model=CommitOut,
    )
    def commit(name: SinkName, batch_id: BatchId, attempt: AttemptNumber, body: CommitRequest, who: Writer) -> Response:
        return _answer(CommitOut.fields_of(
            coordinator.commit(name, batch_id, attempt, body.generation, body.results(), who.actor, body.job_ms)))

    @app.post(
        "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/abort", tags=["protocol"], responses=PROTOCOL,
        response_model=AbortOut,
    )
    def abort(name: SinkName, batch_id: BatchId, attempt: AttemptNumber, body: AbortRequest, who: Writer) -> Response:
        if not who.is_admin and body.generation is None:
            raise e.Invalid("generation_required", "a writer must name its generation", field="generation")
        result, outcome = coordinator.abort_attempt(name, batch_id, attempt, body.generation, body.reason, who.actor)
        return _json(AbortOut.of(result, outcome))

    @app.post("/v1/sinks/{name}/checkpoints/{batch_id}/resume", tags=["protocol"], responses=PROTOCOL,
              response_model=CommitOut)
    def resume(name: SinkName, batch_id: BatchId, _: Writer) -> Response:
        """Finish a decided commit; answers from the record if it is already finished."""
        return _answer(CommitOut.fields_of(coordinator.resume(name, batch_id)))

    # --- reads -------------------------------------------------------------------------------

    @app.get("/v1/sinks/{name}/checkpoints", tags=["reads"], responses=ON_SINK)
    def list_checkpoints(
        name: SinkName,
        _: Writer,
        state: CheckpointState | None = None,
        before_batch: BatchId | None = None,
        limit: PageSize = 50,
    ) -> list[CheckpointOut]:
        """Checkpoints of the sink's current lineage, newest first; page with before_batch."""
        return [CheckpointOut.of(c) for c in coordinator.list_checkpoints(name, state=state, before_batch=before_batch, limit=limit)]

    @app.get("/v1/sinks/{name}/checkpoints/{batch_id}", tags=["reads"], responses=ON_SINK)
    def checkpoint_detail(
        name: SinkName,
        batch_id: BatchId,
        _: Writer,
        lease_state: LeaseState | None = None,
        after_lease_id: AfterLeaseId = 0,
        lease_limit: PageSize = 1000,
    ) -> CheckpointDetailOut:
        """The checkpoint, its attempts, what its decided attempt's winners wrote (records, bytes),
        and its leases by id: at most lease_limit (of lease_state, if given) after after_lease_id.
        lease_counts has its lease count by state; the next page starts after next_after_lease_id
        (null: this page is the last). A wide batch has a lease per partition and try."""
        page = coordinator.checkpoint_leases(name, batch_id, state=lease_state, after_id=after_lease_id,
                                             limit=lease_limit)
        # read after the page, so every listed lease's attempt is in it
        return CheckpointDetailOut.of(coordinator.batch_summary(name, batch_id), page)

    @app.get("/v1/sinks/{name}/transactions/open", tags=["reads"], responses=ON_SINK)
    def open_transactions(name: SinkName, _: Writer) -> list[LeaseOut]:
        """Every transactional id that may hold an unresolved transaction, with its lease."""
        return [LeaseOut.of(x) for x in coordinator.possibly_open_transactions(name)]

    @app.get("/v1/sinks/{name}/events", tags=["reads"], responses=ON_SINK)
    def list_events(
        name: SinkName,
        _: Writer,
        after_id: EventId = 0,
        batch_id: BatchId | None = None,
        limit: PageSize = 100,
    ) -> list[EventOut]:
        """The audit trail, oldest first; page with after_id. A batch on the common path has one
        event, `commit_decided`; its start and commit are on its attempt and checkpoint rows
        (GET …/checkpoints/{batch_id}). Anything else has its own event (docs/protocol.md)."""
        return [EventOut(**ev) for ev in coordinator.list_events(name, after_id=after_id, batch_id=batch_id, limit=limit)]

    # --- broker observations (coordinator/kafka/broker.py) ------------------------------------------

    partition_watch = PartitionWatch()

    @app.post("/v1/sinks/{name}/broker-check", tags=["operator"], responses=ON_SINK)
    def broker_check(name: SinkName, _: Admin) -> list[BrokerCheckOut]:
        """Check the sink's Kafka cluster now: bootstrap and advertised listeners reachable,
        transactions supported, transaction.max.timeout.ms against the sink's timeout, no unknown
        producer under the prefix, authorization. Each verdict in plain words with its fix."""
        return [BrokerCheckOut(**asdict(c)) for c in check_sink_broker(coordinator, name)]

    @app.get("/v1/sinks/{name}/partitions", tags=["operator"], responses=ON_SINK)
    def partitions(
        name: SinkName, _: Admin, min_stall_s: Annotated[float, Query(ge=0, le=86_400)] = 60.0
    ) -> PartitionsOut:
        """High watermark and last stable offset of every partition of the sink's topics; `stuck`
        when the stable offset stayed below the high watermark for at least min_stall_s since an
        earlier call (to this process), with the transaction holding it."""
        return PartitionsOut.of(observe_partitions(coordinator, name, partition_watch, min_stall_s=min_stall_s))

    # --- operator dashboard (coordinator/http/dashboard/) ---------------------------------------------

    dashboard = create_dashboard(
        coordinator, admin_token=admin_token, token_secret=token_secret, viewer_token=dashboard_viewer_token,
        secure_cookie=dashboard_secure_cookie,
    )
    app.mount("/dashboard", dashboard)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Starlette runs no lifespan of a mounted app: the dashboard's (it stops the broker watch's
        # threads) runs inside this one
        async with dashboard.router.lifespan_context(dashboard):
            yield

    app.router.lifespan_context = lifespan

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/", status_code=307)

    # the last middleware added is the outermost: the metrics time the fast lane's answers too
    if fast_lane:
        app.add_middleware(FastLane, api=app, endpoints=(begin_checkpoint, commit), principal_annotation=Writer,
                           principal=writer_without_io,
                           on_loop_calls=calls_on_loop_for(coordinator.engine) if calls_on_loop else 0)
    app.add_middleware(HttpMetricsMiddleware)
    return app


class _Unauthorized(e.ProtocolError):
    status = 401

    def __init__(self) -> None:
        super().__init__("unauthenticated", "send `Authorization: Bearer <token>`")


class _Forbidden(e.ProtocolError):
    status = 403

    def __init__(self, message: str) -> None:
        super().__init__("forbidden", message)
