"""Authentication and authorisation of REST API v1 in-process (http/dependencies.py): no token
(401), a wrong token (403), a writer token scoped to its sink and its protocol calls, rotation; and
the answer never tells which sinks exist: an unknown sink, another sink's and a retired one are
refused alike for any token but the sink's own (issue 50 §4), on every route that names a sink."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi.testclient import TestClient

from coordinator.protocol.invariants import check_unchanged
from coordinator.service import Coordinator
from fixtures.api_app import PREFIX, SINK, admin, error_of, http, setup_sink  # noqa: F401 - fixtures
from fixtures.servers import ProtocolClient


def test_401_without_a_token(http: TestClient, admin: ProtocolClient) -> None:
    w = setup_sink(admin)
    anon = ProtocolClient(http, None)
    error_of(anon.register_sink("other", "other-tx", expect=None), 401, "unauthenticated")
    error_of(anon.request("GET", "/v1/sinks", expect=None), 401, "unauthenticated")
    error_of(anon.start_generation(SINK, "q", "r", expect=None), 401, "unauthenticated")
    error_of(anon.begin(SINK, 0, 1, expect=None), 401, "unauthenticated")
    # not a bearer token
    basic = http.get(f"/v1/sinks/{SINK}", headers={"Authorization": f"Basic {w.token}"})
    error_of(basic, 401, "unauthenticated")
    # nothing was registered by the refused call
    assert [s["name"] for s in admin.request("GET", "/v1/sinks")] == [SINK]


def test_403_with_a_wrong_token(admin: ProtocolClient) -> None:
    setup_sink(admin)
    wrong = admin.with_token("not-the-admin-token")
    error_of(wrong.register_sink("other", "other-tx", expect=None), 403, "forbidden")
    error_of(wrong.request("GET", "/v1/sinks", expect=None), 403, "forbidden")
    error_of(wrong.start_generation(SINK, "q", "r", expect=None), 403, "forbidden")
    error_of(wrong.request("GET", f"/v1/sinks/{SINK}", expect=None), 403, "forbidden")
    # a writer-looking token for an unknown sink is 403 too: tokens do not probe sink names
    error_of(wrong.begin("no-such-sink", 0, 1, expect=None), 403, "forbidden")


def test_writer_token_is_scoped_to_its_sink(admin: ProtocolClient, coordinator: Coordinator) -> None:
    wa = setup_sink(admin, "sink-a", "a-tx")
    wb = setup_sink(admin, "sink-b", "b-tx")
    assert wa.token != wb.token
    gen_b = wb.start_generation("sink-b", "qb", "rb")["generation"]
    wb.begin("sink-b", 0, gen_b, partitions=1)
    before = coordinator.snapshot()
    # A's token on B's routes
    error_of(wa.start_generation("sink-b", "qa", "ra", expect=None), 403, "forbidden")
    error_of(wa.begin("sink-b", 0, gen_b, expect=None), 403, "forbidden")
    error_of(wa.lease("sink-b", 0, 1, gen_b, 0, 1, expect=None), 403, "forbidden")
    error_of(wa.commit("sink-b", 0, 1, gen_b, {0: None}, expect=None), 403, "forbidden")
    error_of(wa.request("GET", "/v1/sinks/sink-b", expect=None), 403, "forbidden")
    error_of(wa.request("GET", "/v1/sinks/sink-b/events", expect=None), 403, "forbidden")
    assert check_unchanged(before, coordinator.snapshot()) == []
    # and on its own sink it works
    assert wa.start_generation("sink-a", "qa", "ra")["generation"] == 1


def test_writer_token_cannot_do_admin_actions(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w = setup_sink(admin)
    w.start_generation(SINK, "query-1", "run-1")
    before = coordinator.snapshot()
    error_of(w.register_sink("other", "other-tx", expect=None), 403, "forbidden")
    error_of(w.register_sink(SINK, PREFIX, expect=None), 403, "forbidden")
    error_of(w.reset_lineage(SINK, expect=None), 403, "forbidden")
    error_of(w.rotate_writer_token(SINK, expect=None), 403, "forbidden")
    error_of(w.request("POST", f"/v1/sinks/{SINK}/retire", {"reason": "mine"}, expect=None), 403, "forbidden")
    error_of(w.request("GET", "/v1/sinks", expect=None), 403, "forbidden")
    assert check_unchanged(before, coordinator.snapshot()) == []
    # the admin token is accepted on a sink's protocol routes (operator actions)
    assert admin.request("GET", f"/v1/sinks/{SINK}")["lineage_query_id"] == "query-1"


def test_rotated_writer_token_stops_working(admin: ProtocolClient) -> None:
    old = setup_sink(admin)
    gen = old.start_generation(SINK, "query-1", "run-1")["generation"]  # warms the token cache
    rotated = admin.rotate_writer_token(SINK)
    new = admin.with_token(rotated["writer_token"])
    assert new.token != old.token
    error_of(old.begin(SINK, 0, gen, expect=None), 403, "forbidden")
    error_of(old.request("GET", f"/v1/sinks/{SINK}", expect=None), 403, "forbidden")
    assert new.begin(SINK, 0, gen)["action"] == "write"
    # registering the same sink again hands out the current token, not the old one
    again = admin.register_sink(SINK, PREFIX, expect=200)
    assert again["writer_token"] == new.token


# --- a retired sink is not disclosed (issue 50 §4) ----------------------------------------------

RETIRED, LIVE, UNKNOWN = "retired-one", "live-one", "no-such-sink"
ADMIN_ONLY = {"writer-token", "retire", "lineage/reset", "lost-data/acknowledge", "broker-check", "partitions"}


def routes_naming_a_sink(generation: int) -> dict[tuple[str, str], Any]:
    """Every route of the API that names a sink, with a valid body for it (None: no body)."""
    attempt = "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}"
    return {
        ("GET", "/v1/sinks/{name}"): None,
        ("POST", "/v1/sinks/{name}/writer-token"): None,
        ("POST", "/v1/sinks/{name}/retire"): {"reason": "again"},
        ("POST", "/v1/sinks/{name}/lineage/reset"): {"reason": "moved"},
        ("POST", "/v1/sinks/{name}/lost-data/acknowledge"): {"reason": "checked"},
        ("POST", "/v1/sinks/{name}/generations"): {"query_id": "query-1", "run_id": "run-2"},
        ("POST", "/v1/sinks/{name}/checkpoints/{batch_id}/begin"): {"generation": generation, "partitions": 1},
        ("POST", f"{attempt}/leases"): {"generation": generation, "partition": 0, "task_attempt_id": 7},
        ("POST", f"{attempt}/commit"): {"generation": generation, "partitions": [{"partition": 0, "lease_id": None}]},
        ("POST", f"{attempt}/abort"): {"generation": generation, "reason": "probe"},
        ("POST", "/v1/sinks/{name}/checkpoints/{batch_id}/resume"): None,
        ("GET", "/v1/sinks/{name}/checkpoints"): None,
        ("GET", "/v1/sinks/{name}/checkpoints/{batch_id}"): None,
        ("GET", "/v1/sinks/{name}/transactions/open"): None,
        ("GET", "/v1/sinks/{name}/events"): None,
        ("POST", "/v1/sinks/{name}/broker-check"): None,
        ("GET", "/v1/sinks/{name}/partitions"): None,
    }


def call(http: TestClient, token: str, method: str, template: str, sink: str, body: Any) -> httpx.Response:
    path = template.format(name=sink, batch_id=0, attempt=1)
    return http.request(method, path, json=body, headers={"Authorization": f"Bearer {token}"})


def test_a_retired_sink_is_refused_like_an_unknown_one_on_every_route(
    http: TestClient, admin: ProtocolClient, coordinator: Coordinator
) -> None:
    """A garbage token and another sink's writer token get the same 403 for a retired sink as for
    an unknown one (and a live one), whatever the route; only the retired sink's own token learns
    that it is retired (409 sink_retired; its event trail stays readable)."""
    retired = setup_sink(admin, RETIRED, "retired-tx")
    gen = retired.start_generation(RETIRED, "query-1", "run-1")["generation"]
    attempt = retired.begin(RETIRED, 0, gen)["attempt"]
    retired.abort(RETIRED, 0, attempt, gen, reason="stopping")
    assert admin.request("POST", f"/v1/sinks/{RETIRED}/retire", {"reason": "moved"})["retired_at"]
    live = setup_sink(admin, LIVE, "live-tx")
    live.start_generation(LIVE, "query-1", "run-1")

    routes = routes_naming_a_sink(gen)
    documented = {(m.upper(), p) for p, ops in http.get("/openapi.json").json()["paths"].items() if "{name}" in p
                  for m in ops}
    assert documented == set(routes), "a route that names a sink is missing here (or gone from the API)"

    before = coordinator.snapshot()
    for (method, template), body in routes.items():
        for token in ("wt_garbage-token", live.token or ""):
            answers = {sink: call(http, token, method, template, sink, body) for sink in (RETIRED, UNKNOWN, LIVE)
                       if not (sink == LIVE and token == live.token)}
            for sink, resp in answers.items():
                error_of(resp, 403, "forbidden")
            bodies = {sink: resp.json() for sink, resp in answers.items()}
            assert bodies[RETIRED] == bodies[UNKNOWN], (method, template, token, bodies)
        own = call(http, retired.token or "", method, template, RETIRED, body)
        if template.rsplit("/{name}/", 1)[-1] in ADMIN_ONLY:
            error_of(own, 403, "forbidden")  # the admin's routes
        elif template.endswith("/events"):
            assert own.status_code == 200 and any(ev["kind"] == "sink_retired" for ev in own.json()), own.text
        else:
            error_of(own, 409, "sink_retired")
    assert check_unchanged(before, coordinator.snapshot()) == []
