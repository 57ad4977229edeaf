"""The operator dashboard's routes over HTTP (FastAPI's TestClient in-process, real Postgres,
record-only Kafka control plane, manual clock): login and sessions, the viewer/admin split, CSRF,
confirmation, and every action's effect on the database and the event trail. What the pages show
is tests/http/test_dashboard_pages.py; the browser half tests/http/test_dashboard_browser.py."""

from __future__ import annotations

from fastapi.testclient import TestClient

from coordinator.http.api import create_app
from coordinator.http.dashboard.routes import SESSION_COOKIE
from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.invariants import check_unchanged
from coordinator.service import Coordinator
from fixtures.dashboard_app import (  # noqa: F401 - fixtures
    ADMIN,
    SECRET,
    VIEWER,
    api,
    attr,
    batch,
    client,
    confirm_and_post,
    csrf_of,
    events,
    login,
    new_sink,
    trail,
)
from fixtures.servers import ProtocolClient

FENCED = ControlPlaneError("EndTxn: broker answered PRODUCER_FENCED (90)", retriable=False, code="producer_fenced")
UNREACHABLE = ControlPlaneError("broker unreachable", retriable=True, code="network_exception")


# --- login and sessions ----------------------------------------------------------------------


def test_pages_need_a_login_and_the_root_leads_to_the_dashboard(client: TestClient) -> None:
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/dashboard/"
    for path in ("/dashboard/", "/dashboard/sinks/orders", "/dashboard/actions/reset-lineage?sink=orders"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/dashboard/login?next=/dashboard/"), path
    assert client.get("/dashboard/static/dashboard.js").status_code == 200  # assets are served, no CDN


def test_login_refuses_a_wrong_token_or_no_name(client: TestClient) -> None:
    for data, message in [({"token": "nope", "operator": "alice"}, "wrong token"),
                          ({"token": ADMIN, "operator": " "}, "enter your name"),
                          ({"token": "", "operator": "alice"}, "wrong token")]:
        r = client.post("/dashboard/login", data=data, follow_redirects=False)
        assert r.status_code == 401 and message in r.text
        assert SESSION_COOKIE not in r.headers.get("set-cookie", "")
    assert client.get("/dashboard/", follow_redirects=False).status_code == 303


def test_session_cookie_is_httponly_strict_and_scoped_to_the_dashboard(client: TestClient) -> None:
    r = client.post("/dashboard/login", data={"token": VIEWER, "operator": "bob"}, follow_redirects=False)
    cookie = r.headers["set-cookie"].lower()
    assert f"{SESSION_COOKIE}=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
    assert "path=/dashboard" in cookie
    assert VIEWER not in r.headers["set-cookie"]  # the token itself is never in the cookie
    assert "secure" not in [part.strip() for part in cookie.split(";")]  # plain HTTP by default


def test_secure_cookie_when_configured(coordinator: Coordinator) -> None:
    app = create_app(coordinator, admin_token=ADMIN, token_secret=SECRET, dashboard_secure_cookie=True)
    with TestClient(app, base_url="https://testserver") as t:
        r = t.post("/dashboard/login", data={"token": ADMIN, "operator": "a"}, follow_redirects=False)
        assert "secure" in [part.strip() for part in r.headers["set-cookie"].lower().split(";")]


def test_login_redirects_only_inside_the_dashboard(client: TestClient) -> None:
    for target, expected in [("/dashboard/sinks/x", "/dashboard/sinks/x"), ("//evil.example/x", "/dashboard/"),
                             ("https://evil.example/", "/dashboard/"), ("/v1/sinks", "/dashboard/")]:
        r = client.post("/dashboard/login", data={"token": ADMIN, "operator": "a", "next": target}, follow_redirects=False)
        assert r.headers["location"] == expected


def test_a_tampered_session_cookie_is_no_session(client: TestClient) -> None:
    login(client)
    value = client.cookies.get(SESSION_COOKIE)
    assert value
    client.cookies.clear()
    client.cookies.set(SESSION_COOKIE, value[:-3] + ("AAA" if not value.endswith("AAA") else "BBB"), path="/dashboard")
    assert client.get("/dashboard/", follow_redirects=False).status_code == 303


def test_logout_needs_the_csrf_token(client: TestClient, api: ProtocolClient) -> None:
    new_sink(api, "orders")
    login(client)
    page = client.get("/dashboard/").text
    client.post("/dashboard/logout", data={"csrf": "forged"}, follow_redirects=False)
    assert client.get("/dashboard/", follow_redirects=False).status_code == 200  # still logged in
    client.post("/dashboard/logout", data={"csrf": csrf_of(page)}, follow_redirects=False)
    assert client.get("/dashboard/", follow_redirects=False).status_code == 303


# --- viewer, admin, CSRF ---------------------------------------------------------------------


def test_a_viewer_sees_everything_and_can_act_on_nothing(client: TestClient, api: ProtocolClient,
                                                         coordinator: Coordinator) -> None:
    gen = new_sink(api, "orders")
    batch(api, "orders", gen, 0, [5], commit=False)
    login(client, VIEWER, "bob")
    assert 'data-testid="operator">bob · viewer' in client.get("/dashboard/").text
    cp_page = client.get("/dashboard/sinks/orders/checkpoints/0").text
    assert "action-abort-attempt" not in cp_page and "action-reset-lineage" not in client.get("/dashboard/sinks/orders").text

    assert client.get("/dashboard/actions/abort-attempt?sink=orders&batch=0&attempt=1").status_code == 403
    before = coordinator.snapshot()
    r = client.post("/dashboard/actions/abort-attempt",
                    data={"csrf": csrf_of(cp_page), "sink": "orders", "batch": "0", "attempt": "1", "reason": "x"})
    assert r.status_code == 403 and "admin session" in r.text
    assert check_unchanged(before, coordinator.snapshot()) == []
    assert events(coordinator, "orders", "attempt_aborted") == []


def test_an_admin_post_without_or_with_a_wrong_csrf_token_is_refused(client: TestClient, api: ProtocolClient,
                                                                   coordinator: Coordinator) -> None:
    gen = new_sink(api, "orders")
    batch(api, "orders", gen, 0, [5], commit=False)
    login(client)
    before = coordinator.snapshot()
    for data in ({}, {"csrf": ""}, {"csrf": "forged-token"}):
        r = client.post("/dashboard/actions/abort-attempt",
                        data={**data, "sink": "orders", "batch": "0", "attempt": "1", "reason": "forged"})
        assert r.status_code == 403 and "CSRF" in r.text
    r = client.post("/dashboard/actions/reset-lineage", data={"sink": "orders", "reason": "forged"})
    assert r.status_code == 403
    assert check_unchanged(before, coordinator.snapshot()) == []
    assert coordinator.get_sink("orders").generation == gen


def test_a_post_without_a_session_is_refused(client: TestClient, api: ProtocolClient) -> None:
    new_sink(api, "orders")
    r = client.post("/dashboard/actions/reset-lineage", data={"sink": "orders", "reason": "x", "csrf": "x"})
    assert r.status_code == 401


def test_the_api_tokens_do_not_open_the_dashboard(client: TestClient) -> None:
    r = client.get("/dashboard/", headers={"Authorization": f"Bearer {ADMIN}"}, follow_redirects=False)
    assert r.status_code == 303  # the dashboard's session, not a bearer token (no CSRF otherwise)


# --- actions ---------------------------------------------------------------------------------


def test_abort_an_attempt_with_confirmation(client: TestClient, api: ProtocolClient, coordinator: Coordinator,
                                            kafka: RecordingControlPlane) -> None:
    gen = new_sink(api, "orders")
    batch(api, "orders", gen, 0, [5, 6], commit=False)
    login(client)
    confirm, done = confirm_and_post(client, "/dashboard/actions/abort-attempt?sink=orders&batch=0&attempt=1",
                                     "driver is gone")
    assert "Abort attempt 1 of batch 0 of sink orders" in confirm
    assert 'data-testid="outcome">attempt 1 of batch 0 is ABORTED' in done
    detail = coordinator.checkpoint_detail("orders", 0)
    assert [a.state.value for a in detail.attempts] == ["ABORTED"] and detail.attempts[0].abort_reason == "driver is gone"
    assert {x.state.value for x in detail.leases} == {"ABORTED"}
    assert {tid for _, tid in kafka.aborts} == {x.transactional_id for x in detail.leases}
    (ev,) = events(coordinator, "orders", "attempt_aborted")
    assert ev["actor"] == "dashboard:alice" and ev["batch_id"] == 0
    # the page says so after the fact, and a repeated action changes nothing
    assert 'data-state="ABORTED"' in client.get("/dashboard/sinks/orders/checkpoints/0").text
    confirm_and_post(client, "/dashboard/actions/abort-attempt?sink=orders&batch=0&attempt=1", "again")
    assert len(events(coordinator, "orders", "attempt_aborted")) == 1


def test_abort_of_a_decided_attempt_is_refused_with_the_reason(client: TestClient, api: ProtocolClient,
                                                                coordinator: Coordinator) -> None:
    gen = new_sink(api, "orders")
    batch(api, "orders", gen, 0, [5])
    login(client)
    _, done = confirm_and_post(client, "/dashboard/actions/abort-attempt?sink=orders&batch=0&attempt=1", "oops")
    assert "Abort an attempt: refused" in done and f"{e.COMMIT_DECIDED}: attempt 1 is COMMITTED" in done
    assert coordinator.checkpoint_detail("orders", 0).checkpoint.state.value == "COMMITTED"


def test_retry_a_decided_commit(client: TestClient, api: ProtocolClient, coordinator: Coordinator,
                                kafka: RecordingControlPlane) -> None:
    gen = new_sink(api, "orders")
    attempt, written = batch(api, "orders", gen, 0, [5], commit=False)
    kafka.fail_next(UNREACHABLE)
    api.commit("orders", 0, attempt, gen, {0: written[0]}, expect=503)  # decided, not committed on Kafka
    assert coordinator.checkpoint_detail("orders", 0).checkpoint.state.value == "COMMITTING"
    login(client)
    page = client.get("/dashboard/sinks/orders/checkpoints/0").text
    assert 'data-testid="action-retry-commit"' in page
    _, done = confirm_and_post(client, "/dashboard/actions/retry-commit?sink=orders&batch=0", "broker is back")
    assert 'data-testid="outcome">batch 0 is COMMITTED' in done
    assert coordinator.checkpoint_detail("orders", 0).checkpoint.state.value == "COMMITTED"
    assert [t.transactional_id for _, t in kafka.commits] == ["orders-eos-0"]
    (ev,) = events(coordinator, "orders", "commit_retried")
    assert ev["actor"] == "dashboard:alice" and ev["batch_id"] == 0 and ev["detail"]["reason"] == "broker is back"
    # finished after its commit call: the trail shows the recovery's event, not the row's mark
    page = client.get("/dashboard/sinks/orders/checkpoints/0").text
    assert trail(page) == [("attempt_started", "", "record"), ("commit_decided", "admin", "event"),
                           ("commit_failed", "coordinator", "event"), ("checkpoint_committed", "recovery", "event"),
                           ("commit_retried", "dashboard:alice", "event")]
    # an open checkpoint has no decided commit to retry: refused, nothing recorded
    batch(api, "orders", gen, 1, [1], commit=False)
    _, done = confirm_and_post(client, "/dashboard/actions/retry-commit?sink=orders&batch=1", "x")
    assert e.NOT_COMMITTING in done
    assert len(events(coordinator, "orders", "commit_retried")) == 1


def test_acknowledge_lost_data(client: TestClient, api: ProtocolClient, coordinator: Coordinator,
                               kafka: RecordingControlPlane) -> None:
    gen = new_sink(api, "payments")
    attempt, written = batch(api, "payments", gen, 0, [5], commit=False)
    kafka.fail_next(FENCED)
    api.commit("payments", 0, attempt, gen, {0: written[0]}, expect=409)
    login(client)
    overview = client.get("/dashboard/").text
    assert attr(overview, "health", "data-kinds") == ["lost"]
    sink_page = client.get("/dashboard/sinks/payments").text
    assert 'data-testid="halted"' in sink_page and "producer_fenced" in sink_page
    assert 'data-testid="lost-reason"' in client.get("/dashboard/sinks/payments/checkpoints/0").text

    _, done = confirm_and_post(client, "/dashboard/actions/acknowledge-lost-data?sink=payments", "re-sent batch 0")
    assert "lost data of batch(es) [0] acknowledged" in done
    assert not coordinator.get_sink("payments").halted
    (ev,) = events(coordinator, "payments", "lost_data_acknowledged")
    assert ev["actor"] == "dashboard:alice" and ev["detail"]["operator"] == "alice"
    assert ev["detail"]["reason"] == "re-sent batch 0"
    assert attr(client.get("/dashboard/").text, "health", "data-level") == ["ok"]


def test_reset_lineage(client: TestClient, api: ProtocolClient, coordinator: Coordinator) -> None:
    gen = new_sink(api, "orders")
    login(client)
    _, done = confirm_and_post(client, "/dashboard/actions/reset-lineage?sink=orders", "new checkpoint location")
    assert f"generation is now {gen + 1}" in done
    sink = coordinator.get_sink("orders")
    assert sink.lineage_query_id is None and sink.generation == gen + 1
    (ev,) = events(coordinator, "orders", "lineage_reset")
    assert ev["actor"] == "dashboard:alice" and ev["detail"]["reason"] == "new checkpoint location"


def test_retire_a_sink_from_its_page_once_nothing_is_open(client: TestClient, api: ProtocolClient,
                                                          coordinator: Coordinator) -> None:
    gen = new_sink(api, "orders")
    attempt, _ = batch(api, "orders", gen, 0, [3], commit=False)  # an undecided attempt with a lease
    login(client)
    assert "action-retire" in client.get("/dashboard/sinks/orders").text
    _, refused = confirm_and_post(client, "/dashboard/actions/retire-sink?sink=orders", "moved")
    assert "cannot be retired yet" in refused and "undecided attempt" in refused
    api.request("POST", f"/v1/sinks/orders/checkpoints/0/attempts/{attempt}/abort", {"reason": "stop"})
    _, done = confirm_and_post(client, "/dashboard/actions/retire-sink?sink=orders", "moved to orders-v2")
    assert "sink orders is retired" in done
    assert "orders" not in [s.name for s in coordinator.list_sinks()]
    assert 'href="/dashboard/sinks/orders"' not in client.get("/dashboard/").text
    (ev,) = events(coordinator, "orders", "sink_retired")
    assert ev["actor"] == "dashboard:alice" and ev["detail"]["reason"] == "moved to orders-v2"


def test_actions_name_what_is_missing(client: TestClient, api: ProtocolClient) -> None:
    new_sink(api, "orders")
    login(client)
    assert client.get("/dashboard/actions/abort-attempt?sink=orders&batch=0").status_code == 422
    assert client.get("/dashboard/actions/abort-attempt?sink=orders&batch=x&attempt=1").status_code == 422
    assert client.get("/dashboard/actions/drop-everything?sink=orders").status_code == 404
    assert client.get("/dashboard/actions/reset-lineage?sink=nosuch").status_code == 404
    r = client.get("/dashboard/sinks/nosuch")
    assert r.status_code == 404 and "no sink named &#39;nosuch&#39;" in r.text
    assert client.get("/dashboard/sinks/orders/checkpoints/7").status_code == 404
    page = client.get("/dashboard/actions/reset-lineage?sink=orders").text
    r = client.post("/dashboard/actions/reset-lineage", data={"csrf": csrf_of(page), "sink": "orders", "reason": " "})
    assert r.status_code == 422 and "give a reason" in r.text
