"""The operator dashboard in a real browser: Playwright drives Debian's chromium (headless, no
network) against a real coordinator process (uvicorn, real Postgres) filled through the HTTP API
with real protocol traffic:

- `orders` and `clicks`: several committed batches (known record counts); `clicks` also has an
  open attempt (for the abort action);
- `inventory`: a 10 s transaction timeout and a written transaction left open past 80 % of it;
- `payments`: a batch whose decided commit Kafka refused for good, so it is LOST and the sink is
  halted. That refusal is the real broker's (tests/fixtures/real_kafka.py): a second coordinator process
  with the Kafka control plane sends EndTxn for a producer the transactional id never had, and
  Kafka answers INVALID_PRODUCER_ID_MAPPING.

The dashboard process runs with the record-only control plane and without the recovery loop, so
nothing but the test changes the data while the pages are checked. Screenshots go to
test-artifacts/ (gitignored).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from fixtures.real_kafka import RealKafka
from fixtures.servers import REPO_ROOT, ProtocolClient, ServiceProcess, Winner

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = REPO_ROOT / "test-artifacts"
ADMIN = "browser-admin-token"
VIEWER = "browser-viewer-token"
NEAR_TIMEOUT_MS = 10_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"Debian's chromium is missing at {CHROMIUM}: install it with `apt-get install -y chromium` "
                    "(.ci/run does); Playwright's own browser download cannot work here", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def services(database_url: str, tmp_path: Path) -> Iterator[dict[str, ServiceProcess]]:
    started: dict[str, ServiceProcess] = {}
    yield started
    for s in started.values():
        if s.alive:
            s.stop()


def writer_for(admin: ProtocolClient, name: str, prefix: str, **extra: Any) -> ProtocolClient:
    token = admin.register_sink(name, prefix, check_broker=False, **extra)["writer_token"]
    return admin.with_token(token)


def write(w: ProtocolClient, sink: str, gen: int, batch: int, records: list[int], *,
          commit: bool = True) -> list[dict[str, Any]]:
    """A batch through the protocol: begin with its pre-leases, each partition's first try claims
    one and writes; the driver commits their records (or not: the tries' transactions stay open)."""
    attempt = w.begin(sink, batch, gen, partitions=len(records))["attempt"]
    leases = [w.lease(sink, batch, attempt, gen, p, 100 * batch + p) for p in range(len(records))]
    if commit:
        w.commit(sink, batch, attempt, gen, {x["partition"]: winner(x, n) for x, n in zip(leases, records, strict=True)})
    return leases


def winner(lease: dict[str, Any], records: int) -> Winner:
    return Winner.of(lease, 9000 + lease["lease_id"], producer_epoch=1, records=records, bytes=records * 50)


def percent(leased_at: str, at: float) -> float:
    return (at - datetime.fromisoformat(leased_at).timestamp()) * 1000 / NEAR_TIMEOUT_MS * 100


def test_dashboard_in_a_browser(browser: Any, services: dict[str, ServiceProcess], database_url: str, tmp_path: Path,
                                real_kafka: RealKafka) -> None:
    broker = real_kafka
    quiet = {"COORDINATOR_RECOVERY_ENABLED": "false"}
    # the sinks are registered through this process: Kafka and recovery timings small enough that
    # the inventory sink's 500 ms commit margin exceeds the commit reach (configuration.CommitReach:
    # 370 ms with these)
    short = {"COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS": "100", "COORDINATOR_KAFKA_RETRY_BUDGET_MS": "100",
             "COORDINATOR_RECOVERY_INTERVAL_MS": "10", "COORDINATOR_RECOVERY_LEADER_TTL_MS": "150"}
    dash = services["dash"] = ServiceProcess(
        database_url, ADMIN, tmp_path, name="dashboard",
        env={**quiet, **short, "COORDINATOR_DASHBOARD_VIEWER_TOKEN": VIEWER})
    kafka_side = services["kafka"] = ServiceProcess(database_url, ADMIN, tmp_path, name="kafka-side", env={
        **quiet, "COORDINATOR_KAFKA_CONTROL_PLANE": "kafka", "COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS": "2000",
        "COORDINATOR_KAFKA_RETRY_BUDGET_MS": "5000"})
    dash.start()
    kafka_side.start()
    dash.wait_ready()
    kafka_side.wait_ready()
    admin = dash.client(ADMIN)

    # --- the data: real protocol traffic over HTTP -------------------------------------------
    inventory = writer_for(admin, "inventory", "inventory-eos", transaction_timeout_ms=NEAR_TIMEOUT_MS,
                           commit_margin_ms=500)
    gen_i = inventory.start_generation("inventory", "q-inventory", "r-1")["generation"]
    write(inventory, "inventory", gen_i, 0, [8])
    (open_lease,) = write(inventory, "inventory", gen_i, 1, [6], commit=False)  # written, left open

    orders = writer_for(admin, "orders", "orders-eos")
    gen_o = orders.start_generation("orders", "q-orders", "r-1")["generation"]
    for batch, records in enumerate([[10, 20], [5, 5, 5], [40]]):
        write(orders, "orders", gen_o, batch, records)

    clicks = writer_for(admin, "clicks", "clicks-eos")
    gen_c = clicks.start_generation("clicks", "q-clicks", "r-1")["generation"]
    write(clicks, "clicks", gen_c, 0, [3])
    write(clicks, "clicks", gen_c, 1, [4])
    write(clicks, "clicks", gen_c, 2, [2], commit=False)  # an executor holds a lease

    payments = writer_for(admin, "payments", "payments-eos", bootstrap_servers=broker.bootstrap, topics=["pay"])
    payments = kafka_side.client(payments.token)
    gen_p = payments.start_generation("payments", "q-payments", "r-1")["generation"]
    (lost_lease,) = write(payments, "payments", gen_p, 0, [12], commit=False)
    refused = payments.commit("payments", 0, 1, gen_p, {0: winner(lost_lease, 12)}, expect=409)
    assert refused["error"]["reason"] == "data_lost", refused
    kafka_side.stop()

    ARTIFACTS.mkdir(exist_ok=True)
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    base = dash.url + "/dashboard"

    # --- login ------------------------------------------------------------------------------
    page.goto(dash.url + "/")
    assert page.url.startswith(base + "/login")
    page.fill("input[name=operator]", "alice")
    page.fill("input[name=token]", ADMIN)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")

    # --- a sink page: charts, table, open transactions, pool -----------------------------------
    page.goto(base + "/sinks/orders")
    bars = page.locator("[data-testid=chart-records] rect")
    assert [(b.get_attribute("data-batch"), b.get_attribute("data-value")) for b in bars.all()] == [
        ("0", "30"), ("1", "15"), ("2", "40")]
    heights = [float(b.get_attribute("height") or 0) for b in bars.all()]
    assert heights[2] > heights[0] > heights[1] > 0 and abs(heights[0] / heights[2] - 30 / 40) < 0.01
    bytes_bars = page.locator("[data-testid=chart-bytes] rect").all()
    assert [b.get_attribute("data-value") for b in bytes_bars] == ["1500", "750", "2000"]
    assert page.locator("[data-testid=chart-commit_ms] rect").count() == 3
    rows = page.locator("[data-testid=checkpoints] tr[data-batch]")
    assert [(r.get_attribute("data-batch"), r.get_attribute("data-state")) for r in rows.all()] == [
        ("2", "COMMITTED"), ("1", "COMMITTED"), ("0", "COMMITTED")]
    assert [r.locator("[data-testid=records]").inner_text() for r in rows.all()] == ["40", "15", "30"]
    assert page.locator("[data-testid=no-open]").is_visible()
    assert page.locator("[data-testid=pool]").get_attribute("data-size") == "3"
    assert page.locator("[data-testid=pool]").get_attribute("data-leased") == "0"  # ids are back after commits
    page.screenshot(path=str(ARTIFACTS / "dashboard-sink-orders.png"), full_page=True)

    # --- a checkpoint page: the lost batch with its winner's record and event trail --------------
    page.goto(base + "/sinks/payments/checkpoints/0")
    assert page.locator("[data-testid=checkpoint-state]").inner_text() == "LOST"
    assert "invalid_producer_id_mapping" in page.locator("[data-testid=lost-reason]").inner_text()
    lease_row = page.locator(f"[data-testid=leases] tr[data-lease='{lost_lease['lease_id']}']")
    assert lease_row.get_attribute("data-state") == "LOST"
    assert lease_row.locator("[data-testid=producer-id]").inner_text() == str(9000 + lost_lease["lease_id"])
    trail = page.locator("[data-testid=events] tr[data-kind]").all()
    kinds = [r.get_attribute("data-kind") for r in trail]
    # the attempt's start comes from its row (no event on the hot path), then the decision and the loss
    assert kinds[:2] == ["attempt_started", "commit_decided"] and "data_lost" in kinds
    assert trail[0].get_attribute("data-source") == "record" and "(attempt row)" in trail[0].inner_text()
    assert trail[1].get_attribute("data-source") == "event" and "checkpoint_committed" not in kinds

    # the inventory transaction is past 80 % of its timeout from here on
    wait_until = datetime.fromisoformat(open_lease["leased_at"]).timestamp() + 0.82 * NEAR_TIMEOUT_MS / 1000
    time.sleep(max(0.0, wait_until - time.time()))

    # --- overview ---------------------------------------------------------------------------
    page.goto(base + "/")
    tiles = {t.get_attribute("data-sink"): t for t in page.locator("[data-testid=sink-tile]").all()}
    assert sorted(tiles) == ["clicks", "inventory", "orders", "payments"]

    def tile(name: str, testid: str, attr: str | None = None) -> str:
        loc = tiles[name].locator(f"[data-testid={testid}]")
        return (loc.get_attribute(attr) if attr else loc.inner_text()) or ""

    assert (tile("payments", "health", "data-level"), tile("payments", "health")) == (
        "critical", "lost data awaiting acknowledgement")
    assert (tile("inventory", "health", "data-level"), tile("inventory", "health")) == ("warn", "transactions near timeout")
    assert tile("orders", "health") == "committing normally" and tile("clicks", "health") == "committing normally"
    assert [tile(n, "last-batch") for n in ("orders", "clicks", "inventory", "payments")] == ["2", "1", "0", "none"]
    assert [tile(n, "generation") for n in ("orders", "payments")] == [str(gen_o), str(gen_p)]
    assert tile("inventory", "open-count") == "1" and tile("clicks", "open-count") == "1"
    page.screenshot(path=str(ARTIFACTS / "dashboard-overview.png"), full_page=True)
    page.click("[data-sink=inventory] h2 a")  # the tile leads to the sink page
    page.wait_for_url(base + "/sinks/inventory")

    before = time.time()
    page.reload()
    after = time.time()
    bar = page.locator("[data-testid=txn-bar]")
    assert bar.count() == 1 and bar.get_attribute("data-tid") == open_lease["transactional_id"]
    shown = float(bar.get_attribute("data-percent") or 0)
    assert 80 <= shown and percent(open_lease["leased_at"], before) - 1 <= shown <= percent(open_lease["leased_at"], after) + 1
    assert (bar.get_attribute("class") or "").split()[-1] == ("critical" if shown >= 100 else "warn")
    fill = bar.locator(".bar-fill").evaluate("e => e.getBoundingClientRect().width / e.parentElement.getBoundingClientRect().width")
    assert abs(fill * 100 - min(shown, 100)) < 1.5
    assert f"{round(shown)}%" in bar.inner_text()
    assert page.locator("[data-testid=pool]").get_attribute("data-percent") == "100.0"  # its one id is leased
    page.screenshot(path=str(ARTIFACTS / "dashboard-sink-inventory.png"), full_page=True)

    # --- an action through its confirmation: acknowledge the lost data ---------------------------
    page.goto(base + "/sinks/payments")
    page.click("[data-testid=action-acknowledge]")
    assert "Acknowledge the lost data of sink payments" in page.locator("[data-testid=confirm-description]").inner_text()
    assert admin.request("GET", "/v1/sinks/payments")["halted"] is True  # nothing happened before confirming
    page.fill("input[name=reason]", "re-sent batch 0 from the source")
    page.click("[data-testid=confirm]")
    assert "acknowledged" in page.locator("[data-testid=outcome]").inner_text()
    assert admin.request("GET", "/v1/sinks/payments")["halted"] is False
    (ack,) = [ev for ev in admin.request("GET", "/v1/sinks/payments/events") if ev["kind"] == "lost_data_acknowledged"]
    assert ack["actor"] == "dashboard:alice" and ack["detail"]["reason"] == "re-sent batch 0 from the source"

    # abort the open attempt of clicks from its checkpoint page
    page.goto(base + "/sinks/clicks/checkpoints/2")
    page.click("[data-testid=action-abort-attempt]")
    page.fill("input[name=reason]", "executor host died")
    page.click("[data-testid=confirm]")
    assert "is ABORTED" in page.locator("[data-testid=outcome]").inner_text()
    detail = admin.request("GET", "/v1/sinks/clicks/checkpoints/2")
    assert [a["state"] for a in detail["attempts"]] == ["ABORTED"]
    assert [x["state"] for x in detail["leases"]] == ["ABORTED"]

    # --- the overview refreshes itself --------------------------------------------------------
    page.goto(base + "/")
    orders_last = page.locator("[data-sink=orders] [data-testid=last-batch]")
    assert orders_last.inner_text() == "2"
    assert page.locator("[data-sink=payments] [data-testid=health]").get_attribute("data-level") == "ok"
    write(orders, "orders", gen_o, 3, [1])
    page.wait_for_function(
        "() => document.querySelector('[data-sink=orders] [data-testid=last-batch]').textContent === '3'", timeout=30_000)

    # --- refused: a viewer's action, and a forged POST without the CSRF token --------------------
    viewer_ctx = browser.new_context()
    viewer = viewer_ctx.new_page()
    viewer.goto(base + "/login")
    viewer.fill("input[name=operator]", "bob")
    viewer.fill("input[name=token]", VIEWER)
    viewer.click("button[type=submit]")
    viewer.wait_for_url(base + "/")
    viewer.goto(base + "/sinks/orders")
    assert viewer.locator("[data-testid=action-reset-lineage]").count() == 0
    response = viewer.goto(base + "/actions/reset-lineage?sink=orders")
    assert response is not None and response.status == 403
    viewer_csrf = viewer.locator("input[name=csrf]").first.get_attribute("value")
    refused_post = viewer_ctx.request.post(base + "/actions/reset-lineage",
                                           form={"csrf": viewer_csrf or "", "sink": "orders", "reason": "x"})
    assert refused_post.status == 403
    forged = ctx.request.post(base + "/actions/reset-lineage", form={"sink": "orders", "reason": "forged"})
    assert forged.status == 403 and "CSRF" in forged.text()
    sink = admin.request("GET", "/v1/sinks/orders")
    assert sink["generation"] == gen_o and sink["lineage_query_id"] == "q-orders"
    assert [ev for ev in admin.request("GET", "/v1/sinks/orders/events", params={"limit": 1000})
            if ev["kind"] == "lineage_reset"] == []
    viewer_ctx.close()
    ctx.close()

    for name in ("dashboard-overview.png", "dashboard-sink-orders.png", "dashboard-sink-inventory.png"):
        assert (ARTIFACTS / name).stat().st_size > 10_000, name
    assert not re.search(r"Traceback", dash.log(400)), dash.log(400)
