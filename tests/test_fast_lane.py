"""The fast lane for begin and commit (coordinator/http/fast_lane.py) answers exactly as FastAPI does.

Two apps, each served by a real uvicorn (in a thread of this process, so the lane's counts can be
read) over its own freshly migrated Postgres: one with the fast lane, one without. Every request
goes to both in lockstep, so both databases go through the same states (a manual clock each: the
answers' times are equal too), and the answers must be byte for byte the same (status, headers but
the date, body). Each case also says who answered on the fast side: the lane itself, or the
FastAPI app it passed the request on to; so the test cannot pass by the lane always passing on.
The Kafka control plane is record-only: nothing here is about Kafka."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.exc import OperationalError

from coordinator.http.api import create_app
from coordinator.http.fast_lane import FastLane
from coordinator.http.input import MAX_BODY_BYTES
from coordinator.kafka.control_plane import RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.service import Coordinator, Limits
from coordinator.service.clock import ManualClock
from coordinator.store.db import make_engine
from fixtures.postgres import migrated_database
from fixtures.servers import ProtocolClient, uvicorn_in_thread

ADMIN = "fast-lane-admin-token-1c2d"
SECRET = b"fast-lane-writer-secret"
SINK, OTHER = "orders", "payments"
BEGIN = "/v1/sinks/{name}/checkpoints/{batch_id}/begin"
COMMIT = "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/commit"


@dataclass
class Pair:
    fast: httpx.Client
    slow: httpx.Client
    lane: FastLane
    coordinators: tuple[Coordinator, Coordinator]
    writer: str  # SINK's writer token (the same on both sides: same secret, same sink id)
    other_writer: str

    def send(self, method: str, path: str, body: Any = None, *, token: str | None = "writer",
             content: Any = None, headers: dict[str, str] | None = None) -> tuple[httpx.Response, str]:
        """The same request to both apps; asserts the same answer. Returns the fast side's answer
        and who gave it: "lane", "passed_on" (the lane handed it to FastAPI) or "not_lane" (not
        a request for the lane at all)."""
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = "Bearer " + {"writer": self.writer, "other": self.other_writer,
                                              "admin": ADMIN}.get(token, token)
        kwargs: dict[str, Any] = {"headers": h}
        if content is not None:
            kwargs["content"] = content() if callable(content) else content
        elif body is not None:
            kwargs["json"] = body
        answered, passed_on = self.lane.answered, self.lane.passed_on
        a = self.fast.request(method, path, **kwargs)
        if content is not None and callable(content):
            kwargs["content"] = content()  # a generator is spent by the first request
        b = self.slow.request(method, path, **kwargs)
        where = f"{method} {path} {body if body is not None else content!r}"
        assert (a.status_code, a.content) == (b.status_code, b.content), (
            f"{where}: fast lane {a.status_code} {a.text[:500]} != FastAPI {b.status_code} {b.text[:500]}")
        assert _headers(a) == _headers(b), where
        if self.lane.answered > answered:
            who = "lane"
        elif self.lane.passed_on > passed_on:
            who = "passed_on"
        else:
            who = "not_lane"
        assert self.lane.answered + self.lane.passed_on - answered - passed_on <= 1
        return a, who


def _headers(r: httpx.Response) -> list[tuple[str, str]]:
    """All but the date, with the server's own address (each app has its port) taken out."""
    origin = f"{r.request.url.scheme}://{r.request.url.netloc.decode()}"
    return [(k, v.replace(origin, "")) for k, v in r.headers.multi_items() if k != "date"]


@pytest.fixture(params=[True, False], ids=["calls-on-loop", "calls-in-threads"])
def pair(request: pytest.FixtureRequest, postgres_server_url: str, template_url: str) -> Iterator[Pair]:
    with ExitStack() as stack:
        clients, coordinators, lanes = [], [], []
        for fast in (True, False):
            url = stack.enter_context(migrated_database(postgres_server_url, "lane" if fast else "nolane"))
            engine = make_engine(url, pool_size=5)
            stack.callback(engine.dispose)
            c = Coordinator(engine, RecordingControlPlane(), clock=ManualClock(), limits=Limits(max_partitions=256))
            stack.callback(c.close)
            app = create_app(c, admin_token=ADMIN, token_secret=SECRET, fast_lane=fast, calls_on_loop=request.param)
            base = stack.enter_context(uvicorn_in_thread(app))
            clients.append(stack.enter_context(httpx.Client(base_url=base, timeout=60)))
            coordinators.append(c)
            lanes.append(getattr(app.state, "fast_lane", None))
        assert isinstance(lanes[0], FastLane) and lanes[1] is None, "one app with the lane, one without"
        assert lanes[0].on_loop_free == (5 if request.param else 0), "half the pool of 2 x 5 connections"
        tokens = []
        for client in clients:
            admin = ProtocolClient(client, ADMIN)
            tokens.append((admin.register_sink(SINK, "orders-tx", expect=201)["writer_token"],
                           admin.register_sink(OTHER, "payments-tx", expect=201)["writer_token"]))
        assert tokens[0] == tokens[1]
        yield Pair(clients[0], clients[1], lanes[0], (coordinators[0], coordinators[1]), *tokens[0])


def begin_path(batch: Any, sink: str = SINK) -> str:
    return f"/v1/sinks/{sink}/checkpoints/{batch}/begin"


def commit_path(batch: Any, attempt: Any, sink: str = SINK) -> str:
    return f"/v1/sinks/{sink}/checkpoints/{batch}/attempts/{attempt}/commit"


def chunked(*parts: bytes) -> Any:
    return lambda: iter(parts)  # httpx sends an iterator with Transfer-Encoding: chunked


def test_every_answer_is_the_one_fastapi_gives(pair: Pair) -> None:
    p = pair
    gen = p.send("POST", f"/v1/sinks/{SINK}/generations", {"query_id": "q", "run_id": "r1"})[0].json()["generation"]
    p.send("POST", f"/v1/sinks/{OTHER}/generations", {"query_id": "q", "run_id": "r1"}, token="other")

    def case(expect: tuple[int, str], method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        resp, who = p.send(method, path, body, **kw)
        assert (resp.status_code, who) == expect, f"{method} {path} {body!r} {kw}: {resp.status_code} {resp.text[:300]}"
        return resp

    ok = {"generation": gen}
    # --- begin: the happy path, by the lane
    first = case((200, "lane"), "POST", begin_path(0), {"generation": gen, "partitions": 2, "offsets": "o:0"})
    assert first.json()["action"] == "write" and len(first.json()["pre_leases"]) == 2
    case((200, "lane"), "POST", begin_path(0), {"generation": gen, "partitions": 2, "offsets": "o:0"})  # a retry
    case((200, "lane"), "POST", begin_path(1), ok, token="admin")
    case((200, "lane"), "POST", begin_path(1), {"generation": "1"})  # lax, as FastAPI validates it
    for accepted in ("01", "%201", "+1", "1_0"):  # as pydantic's lax int reads a path parameter
        case((200, "lane"), "POST", begin_path(accepted), ok)
    case((200, "lane"), "POST", begin_path(1), content=b'{"generation": 1}',
         headers={"Content-Type": "application/merge-patch+json; charset=utf-8"})
    case((200, "lane"), "POST", begin_path(1), content=chunked(b'{"genera', b'tion": ', b"1}"),
         headers={"Content-Type": "application/json"})
    case((200, "lane"), "POST", begin_path(1), ok, token=f"  {p.writer}")
    case((200, "lane"), "POST", begin_path(1), ok, headers={"Authorization": f"bearer {p.writer}"}, token=None)
    case((200, "lane"), "POST", begin_path(1) + "?unused=1", ok)
    # --- refused before the service: FastAPI answers
    for bad in ("-1", "abc", str(2**63), "1.5", "%C2%B9"):
        case((422, "passed_on"), "POST", begin_path(bad), ok)
    case((422, "passed_on"), "POST", begin_path(0, sink="-bad"), ok)
    case((422, "passed_on"), "POST", begin_path(0, sink="orders%FF"), ok)  # not UTF-8
    case((422, "passed_on"), "POST", begin_path(0) + "?q=%FF", ok)
    case((415, "passed_on"), "POST", begin_path(0), content=b'{"generation": 1}', headers={"Content-Type": "text/plain"})
    case((415, "passed_on"), "POST", begin_path(0), content=b'{"generation": 1}')  # no content type
    case((413, "passed_on"), "POST", begin_path(0), content=b" " * (MAX_BODY_BYTES + 1),
         headers={"Content-Type": "application/json"})
    case((413, "passed_on"), "POST", begin_path(0), content=chunked(*[b" " * (1 << 20)] * 8, b'{"generation": 1}'),
         headers={"Content-Type": "application/json"})  # no length: refused while reading
    # the lane parses the body with pydantic's own JSON parser: every body the API's strict parser
    # refuses must reach the API (its answer names the problem), and every body both accept must
    # mean the same (the answers are compared byte for byte)
    for raw in (b'{"generation":', b'{"generation": NaN}', b'{"generation": "\xff"}', b"[" * 40 + b"]" * 40,
                b"", b'{"generation": 1' + b"0" * 5000 + b"}", b'\xef\xbb\xbf{"generation": 1}',
                b'{"generation": 1, "partitions": Infinity}', b'{"generation": 1}\x00', b'{"generation": 1e400}',
                b'{"generation": 01}', b"{'generation': 1}", b'{"generation": 1,}', b'{"generation": 1 /* c */}',
                b'{"generation": 1, "offsets": "\\ud800"}', b'{"generation": 1, "extra": [' * 20 + b"]" * 20 + b"}"):
        case((422, "passed_on"), "POST", begin_path(0), content=raw, headers={"Content-Type": "application/json"})
    for raw in (b'{"generation": 0, "generation": %d}' % gen, b' {"generation": %d}\n' % gen,
                b'{"generation": %de0}' % gen, b'{"generation": "%d", "offsets": "o:\\u0030"}' % gen):
        case((200, "lane"), "POST", begin_path(5), content=raw, headers={"Content-Type": "application/json"})
    for body in ({"generation": 0}, {"generation": gen, "partitions": -1}, {"generation": gen, "offsets": "a b"},
                 {"generation": gen, "extra": 1}, {}, [], "x", 1):
        case((422, "passed_on"), "POST", begin_path(0), body)
    case((401, "passed_on"), "POST", begin_path(0), ok, token=None)
    case((401, "passed_on"), "POST", begin_path(0), ok, token=None, headers={"Authorization": f"Basic {p.writer}"})
    case((401, "passed_on"), "POST", begin_path(0), ok, token=None, headers={"Authorization": "Bearer"})
    case((403, "passed_on"), "POST", begin_path(0), ok, token="wt_not-a-token")
    case((403, "passed_on"), "POST", begin_path(0), ok, token="other")  # another sink's token
    case((403, "passed_on"), "POST", begin_path(0, sink="nosuch"), ok)  # unknown sink, writer token
    case((405, "not_lane"), "GET", begin_path(0))
    case((307, "not_lane"), "POST", begin_path(0) + "/", ok)  # Starlette's redirect without the slash
    # --- refused by the service: the lane calls it, the app's handlers answer
    case((404, "lane"), "POST", begin_path(0, sink="nosuch"), ok, token="admin")
    gen2 = p.send("POST", f"/v1/sinks/{SINK}/generations", {"query_id": "q", "run_id": "r2"})[0].json()["generation"]
    stale = case((409, "lane"), "POST", begin_path(2), {"generation": gen})
    assert stale.json()["error"]["reason"] == "stale_generation", stale.text
    case((200, "lane"), "POST", begin_path(2), {"generation": gen2, "partitions": 2})
    # --- commit
    begun = case((200, "lane"), "POST", begin_path(3), {"generation": gen2, "partitions": 2}).json()
    attempt, leases = begun["attempt"], [x["lease_id"] for x in begun["pre_leases"]]
    record = {"producer_id": 7, "producer_epoch": 0, "records": 3, "bytes": 300}
    commit_body = {"generation": gen2, "job_ms": 5, "partitions": [
        {"partition": 0, "lease_id": leases[0], **record, "first_offsets": [["out", 0, 10]]},
        {"partition": 1, "lease_id": None}]}
    for bad_attempt in ("0", "x", str(2**31)):
        case((422, "passed_on"), "POST", commit_path(3, bad_attempt), commit_body)
    for body in ({"generation": gen2}, {**commit_body, "partitions": [{"partition": 0, "lease_id": leases[0],
                                                                       "producer_id": 7}]},
                 {**commit_body, "job_ms": -1}):
        case((422, "passed_on"), "POST", commit_path(3, attempt), body)
    case((403, "passed_on"), "POST", commit_path(3, attempt), commit_body, token="other")
    fenced = case((409, "lane"), "POST", commit_path(3, attempt), {**commit_body, "generation": gen})
    assert fenced.json()["error"]["reason"] == "stale_generation", fenced.text
    case((404, "lane"), "POST", commit_path(99, 1), commit_body)
    case((404, "lane"), "POST", commit_path(3, attempt + 5), commit_body)
    committed = case((200, "lane"), "POST", commit_path(3, attempt), commit_body).json()
    assert committed["state"] == "COMMITTED" and [w["partition"] for w in committed["committed"]] == [0]
    case((200, "lane"), "POST", commit_path(3, attempt), commit_body)  # a retry answers the same
    case((200, "lane"), "POST", begin_path(3), {"generation": gen2})  # skip: committed
    # a large commit (200 partitions, 160 of them empty) too
    begun = case((200, "lane"), "POST", begin_path(4), {"generation": gen2, "partitions": 200}).json()
    large = {"generation": gen2, "partitions": [
        {"partition": x["partition"], "lease_id": x["lease_id"], **record,
         "first_offsets": [["out", t, 10 * t] for t in range(8)]} if x["partition"] < 40
        else {"partition": x["partition"], "lease_id": None} for x in begun["pre_leases"]]}
    assert len(json.dumps(large)) > 8 * 1024
    big = case((200, "lane"), "POST", commit_path(4, begun["attempt"]), large).json()
    assert big["state"] == "COMMITTED" and len(big["committed"]) == 40
    # --- a retired sink: every call is refused alike
    p.send("POST", f"/v1/sinks/{OTHER}/retire", {"reason": "done"}, token="admin")
    retired = case((409, "lane"), "POST", begin_path(0, sink=OTHER), ok, token="admin")
    assert retired.json()["error"]["reason"] == "sink_retired", retired.text
    case((409, "passed_on"), "POST", begin_path(0, sink=OTHER), ok, token="other")  # retiring emptied the cache
    case((409, "lane"), "POST", commit_path(0, 1, sink=OTHER), commit_body, token="admin")
    # the API's document is the same
    assert p.fast.get("/openapi.json").json() == p.slow.get("/openapi.json").json()


def test_errors_the_app_has_no_handler_for_are_answered_500_and_handled_ones_by_their_handler(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = pair
    gen = p.send("POST", f"/v1/sinks/{SINK}/generations", {"query_id": "q", "run_id": "r1"})[0].json()["generation"]
    raised: list[BaseException] = []

    def failing(*_: Any, **__: Any) -> Any:
        raise raised[-1]

    for c in p.coordinators:
        monkeypatch.setattr(c, "begin_checkpoint", failing)
    cases = [
        (RuntimeError("a bug"), 500),  # ServerErrorMiddleware's plain 500, as today
        (OperationalError("SELECT 1", {}, Exception("server closed the connection")), 503),
        (e.Conflict("stale_generation", "a newer generation exists"), 409),  # a subclass of ProtocolError
    ]
    for exc, status in cases:
        raised.append(exc)
        resp, who = p.send("POST", begin_path(0), {"generation": gen})
        assert (resp.status_code, who) == (status, "lane"), resp.text


def _samples(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_the_lanes_answers_under_the_route_templates(pair: Pair) -> None:
    p = pair
    gen = p.send("POST", f"/v1/sinks/{SINK}/generations", {"query_id": "q", "run_id": "r1"})[0].json()["generation"]
    p.send("POST", f"/v1/sinks/{SINK}/generations", {"query_id": "q", "run_id": "r2"})
    gen2 = gen + 1

    def http(route: str, status: int) -> tuple[str, tuple[tuple[str, str], ...]]:
        return ("coordinator_http_request_duration_seconds_count",
                (("method", "POST"), ("route", route), ("status", str(status))))

    fenced_key = ("coordinator_fenced_requests_total", (("reason", "stale_generation"),))
    before = _samples(p.fast)
    answered = p.lane.answered
    # the fast app alone from here (the two apps share this process's metrics registry)
    for batch in range(3):
        begun = p.fast.post(begin_path(batch), json={"generation": gen2, "partitions": 1},
                            headers={"Authorization": f"Bearer {p.writer}"}).json()
        body = {"generation": gen2, "partitions": [{"partition": 0, "lease_id": begun["pre_leases"][0]["lease_id"],
                                                    "producer_id": 1, "producer_epoch": 0, "records": 1, "bytes": 1}]}
        assert p.fast.post(commit_path(batch, begun["attempt"]), json=body,
                           headers={"Authorization": f"Bearer {p.writer}"}).status_code == 200
    assert p.fast.post(begin_path(9), json={"generation": gen},
                       headers={"Authorization": f"Bearer {p.writer}"}).status_code == 409
    assert p.lane.answered - answered == 7, "the lane answered every call"
    after = _samples(p.fast)

    def delta(key: tuple[str, tuple[tuple[str, str], ...]]) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta(http(BEGIN, 200)) == 3
    assert delta(http(COMMIT, 200)) == 3
    assert delta(http(BEGIN, 409)) == 1
    assert delta(fenced_key) == 1
    unmatched = [k for k in after if k[0] == "coordinator_http_request_duration_seconds_count"
                 and dict(k[1])["route"] == "<unmatched>" and delta(k)]
    assert not unmatched, unmatched


def test_the_common_calls_run_on_the_loop_and_a_call_that_would_block_it_runs_again_in_a_thread(
    pair: Pair,
) -> None:
    """begin and commit's common path runs driver statements only: on the loop, start to end. A
    sink's first batch grows its id pool with SQLAlchemy statements, and a retried begin reads its
    leases back with one; either would block the loop, so it runs again in a thread, and answers
    as FastAPI does (Pair.send compares)."""
    p = pair
    on_loop = p.lane.on_loop_free > 0
    gen = p.send("POST", f"/v1/sinks/{SINK}/generations", {"query_id": "q", "run_id": "r1"})[0].json()["generation"]
    reruns = first_reruns = p.lane.rerun_in_thread
    counted = ("coordinator_http_calls_run_again_in_thread_total", ())
    counted_before = _samples(p.fast).get(counted, 0.0)
    for batch in range(4):
        if batch == 1:
            assert p.lane.rerun_in_thread == reruns + (1 if on_loop else 0), "the pool's growth ran in a thread"
            reruns = p.lane.rerun_in_thread
        begun, who = p.send("POST", begin_path(batch), {"generation": gen, "partitions": 2})
        assert who == "lane"
        body = {"generation": gen, "partitions": [
            {"partition": x["partition"], "lease_id": x["lease_id"], "producer_id": 1, "producer_epoch": 0,
             "records": 1, "bytes": 1} for x in begun.json()["pre_leases"]]}
        committed, who = p.send("POST", commit_path(batch, begun.json()["attempt"]), body)
        assert (committed.status_code, who) == (200, "lane"), committed.text
    assert p.lane.rerun_in_thread == reruns, "no common call left the loop"
    begun, _ = p.send("POST", begin_path(4), {"generation": gen, "partitions": 2})
    again, who = p.send("POST", begin_path(4), {"generation": gen, "partitions": 2})
    assert who == "lane" and again.json()["pre_leases"] == begun.json()["pre_leases"]
    assert p.lane.rerun_in_thread == reruns + (1 if on_loop else 0)
    assert p.lane.on_loop_free == (5 if on_loop else 0), "every call gave its place back"
    assert _samples(p.fast)[counted] - counted_before == p.lane.rerun_in_thread - first_reruns


def test_a_lane_call_holds_a_token_of_the_limiter_it_is_given_while_it_runs() -> None:
    """The lane's calls share anyio's default limiter with FastAPI's sync routes (the database
    pool is sized for it), and take a free token without a turn of the event loop: a call waits
    while the limiter is full and runs once a token comes back; an error gives its token back."""
    import asyncio

    import anyio

    from coordinator.http.fast_lane import _token_of

    async def scenario() -> list[tuple[str, str, int]]:
        limiter = anyio.CapacityLimiter(1)
        seen: list[tuple[str, str, int]] = []

        async def call(name: str, hold: float, fail: bool = False) -> None:
            try:
                async with _token_of(limiter):
                    seen.append((name, "runs", limiter.borrowed_tokens))
                    await asyncio.sleep(hold)
                    if fail:
                        raise ValueError(name)
                    seen.append((name, "ends", limiter.borrowed_tokens))
            except ValueError:
                seen.append((name, "failed", limiter.borrowed_tokens))

        await asyncio.wait_for(asyncio.gather(call("a", 0.05, fail=True), call("b", 0.0), call("c", 0.0)), 10)
        seen.append(("after", "all", limiter.borrowed_tokens))
        return seen

    assert asyncio.run(scenario()) == [
        ("a", "runs", 1),
        ("a", "failed", 1),  # its token went to b, who was waiting for it
        ("b", "runs", 1), ("b", "ends", 1), ("c", "runs", 1), ("c", "ends", 1),
        ("after", "all", 0),
    ]
