"""What the operator dashboard's pages show (FastAPI's TestClient in-process, real Postgres,
record-only Kafka control plane, manual clock): the figures of the protocol, a wide batch a page
at a time, the open transactions nearest their timeout, the health findings (near timeout, stuck
offsets, lingering transactions) from the broker watch, escaping, pruned history."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from coordinator.http.api import create_app
from coordinator.http.dashboard import create_dashboard
from coordinator.http.dashboard.broker_watch import BrokerWatch
from coordinator.http.dashboard.views import BARS_SHOWN, DETAIL_ITEMS, LEASES_SHOWN
from coordinator.kafka.broker import PartitionWatch
from coordinator.kafka.control_plane import OpenTransaction, PartitionStability, RecordingControlPlane
from coordinator.protocol.model import PartitionResult, PrecommitRecord
from coordinator.protocol.states import LeaseState
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from fixtures.dashboard_app import (  # noqa: F401 - fixtures
    ADMIN,
    SECRET,
    api,
    attr,
    batch,
    client,
    login,
    new_sink,
    trail,
)
from fixtures.servers import ProtocolClient, Winner


def test_pages_show_the_figures_of_the_protocol(client: TestClient, api: ProtocolClient, coordinator: Coordinator,
                                                clock: ManualClock) -> None:
    gen = new_sink(api, "orders")
    batch(api, "orders", gen, 0, [10, 20])
    clock.advance(seconds=2)
    batch(api, "orders", gen, 1, [7])
    batch(api, "orders", gen, 2, [3], commit=False)  # written, attempt still open
    clock.advance(seconds=1)
    new_sink(api, "clicks")
    login(client)

    overview = client.get("/dashboard/").text
    assert attr(overview, "sink-tile", "data-sink") == ["clicks", "orders"]
    assert re.findall(r'data-testid="last-batch">([^<]*)<', overview) == ["none", "1"]
    assert attr(overview, "health", "data-level") == ["ok", "ok"]

    page = client.get("/dashboard/sinks/orders").text
    assert re.findall(r'data-batch="(\d+)" data-value="([\d.]+)"', page.split('data-testid="chart-records"')[1]
                      .split("</figure>")[0]) == [("0", "30"), ("1", "7")]
    assert attr(page, "txn-bar", "data-percent") == ["1.7"]  # 1 s of 60 s
    # ids come back to the pool after each commit: two ids served three batches
    assert attr(page, "pool", "data-leased") == ["1"] and attr(page, "pool", "data-size") == ["2"]

    clock.advance(seconds=48)  # 49 s of 60: past 80 %
    overview = client.get("/dashboard/").text
    assert attr(overview, "health", "data-kinds")[1] == "near_timeout"
    page = client.get("/dashboard/sinks/orders").text
    assert attr(page, "txn-bar", "data-percent") == ["81.7"]
    assert re.search(r'class="bar-row warn" data-testid="txn-bar" data-tid="orders-eos-\d+"', page)

    cp = client.get("/dashboard/sinks/orders/checkpoints/0").text
    assert 'data-testid="checkpoint-state">COMMITTED<' in cp
    leases = coordinator.checkpoint_detail("orders", 0).leases
    assert re.findall(r'data-testid="producer-id">(\d+)<', cp) == [str(7000 + x.id) for x in leases]
    assert re.findall(r'data-testid="records">([^<]+)<', cp) == ["30 / 300"]
    # one event for the batch (its decision); its start and commit come from the attempt and checkpoint rows
    assert trail(cp) == [("attempt_started", "", "record"), ("commit_decided", "admin", "event"),
                         ("checkpoint_committed", "", "record")]
    assert [ev["kind"] for ev in coordinator.list_events("orders", batch_id=0)] == ["commit_decided"]
    assert "(attempt row)" in cp and "(checkpoint row)" in cp


def test_batch_figures_sum_the_winning_records_only(client: TestClient, api: ProtocolClient,
                                                    coordinator: Coordinator) -> None:
    gen = new_sink(api, "orders")
    batch(api, "orders", gen, 0, [999], commit=False)  # its first attempt wrote, then its driver gave up
    api.abort("orders", 0, 1, gen)
    second = api.begin("orders", 0, gen)["attempt"]
    written = {}
    for partition, task, n in [(0, 10, 10), (1, 11, 32), (1, 12, 7)]:  # task 12: a speculative copy that loses
        lease = api.lease("orders", 0, second, gen, partition, task)
        written[task] = Winner.of(lease, producer_id=task, records=n, bytes=n * 10)
    api.commit("orders", 0, second, gen, {0: written[10], 1: written[11]})
    batch(api, "orders", gen, 1, [5], commit=False)  # written, undecided: no figures yet

    assert [(b.records, b.bytes) for b in coordinator.checkpoint_history("orders")] == [(None, None), (42, 420)]
    login(client)
    page = client.get("/dashboard/sinks/orders").text
    assert re.findall(r'data-batch="(\d+)" data-value="([\d.]+)"', page.split('data-testid="chart-records"')[1]
                      .split("</figure>")[0]) == [("0", "42")]
    assert re.findall(r'data-testid="records">([^<]*)<', page) == ["", "42"]
    assert re.findall(r'data-testid="records">([^<]+)<', client.get("/dashboard/sinks/orders/checkpoints/0").text) \
        == ["42 / 420"]


@pytest.mark.perf  # a statement count: the cost of a refresh, not what the page shows
def test_a_sink_page_sums_a_decided_batchs_leases_once(client: TestClient, api: ProtocolClient,
                                                      coordinator: Coordinator) -> None:
    """A decided batch's sums never change, and a wide batch's thousands of leases are what costs:
    the page refreshes every few seconds and asks Postgres only for the batches decided since."""
    from sqlalchemy import event

    sums: list[list[int]] = []

    def count(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if "sum(" in statement:
            sums.append([v for k, v in sorted(parameters.items()) if k.startswith("attempt_id")])

    gen = new_sink(api, "orders")
    batch(api, "orders", gen, 0, [10, 20])
    login(client)
    event.listen(coordinator.engine, "before_cursor_execute", count)
    try:
        assert client.get("/dashboard/sinks/orders").status_code == 200
        assert client.get("/dashboard/sinks/orders").status_code == 200
        assert len(sums) == 1  # the second render summed nothing
        batch(api, "orders", gen, 1, [7])
        batch(api, "orders", gen, 2, [3], commit=False)
        page = client.get("/dashboard/sinks/orders").text
    finally:
        event.remove(coordinator.engine, "before_cursor_execute", count)
    assert len(sums) == 2 and len(sums[1]) == 1  # batch 1's attempt alone; batch 2 is undecided
    assert re.findall(r'data-testid="records">([^<]*)<', page) == ["", "7", "30"]


def test_a_wide_batch_shows_its_leases_a_page_at_a_time_and_its_decision_cut_short(
        client: TestClient, api: ProtocolClient, coordinator: Coordinator) -> None:
    gen = new_sink(api, "wide")
    assert coordinator.begin_checkpoint("wide", 0, gen, "test", partitions=250).pre_leased == 250
    # every third partition empty (no try asks for a lease); the others' first tries claim theirs
    claimed = {p: coordinator.lease("wide", 0, 1, gen, p, 5000 + p).lease for p in range(250) if p % 3}
    results = [PartitionResult(p, claimed[p].id, PrecommitRecord(5000 + p, 100 + p, 0, 3, 30, 1))
               if p in claimed else PartitionResult(p, None) for p in range(250)]
    coordinator.commit("wide", 0, 1, gen, results, "test")
    every = coordinator.checkpoint_detail("wide", 0).leases
    assert len(every) == 250
    login(client)

    def rows(path: str) -> tuple[list[int], str]:
        html = client.get(path).text
        return [int(x) for x in re.findall(r'data-lease="(\d+)"', html)], html

    listed, path = [], "/dashboard/sinks/wide/checkpoints/0"
    while True:
        ids, html = rows(path)
        assert 0 < len(ids) <= LEASES_SHOWN
        listed += ids
        more = re.search(r'data-testid="more-leases" href="([^"]+)"', html)
        if more is None:
            break
        path = more.group(1).replace("&amp;", "&")
    assert listed == sorted(x.id for x in every)  # two pages, each lease once, in order
    counts = dict(re.findall(r'data-state="([A-Z_]+)" data-count="(\d+)"', html))
    assert counts == {"ABORTED": "84", "COMMITTED": "166"}  # partitions 0, 3, ... 249 were empty
    assert re.findall(r'data-testid="records">([^<]+)<', html) == ["498 / 4,980"]

    aborted, html = rows("/dashboard/sinks/wide/checkpoints/0?lease_state=ABORTED")
    assert aborted == sorted(x.id for x in every if x.state is LeaseState.ABORTED)
    assert 'data-testid="more-leases"' not in html
    # the decision names 166 winners ([partition, lease id]); the page shows the first DETAIL_ITEMS of a list
    decision = next(ev for ev in coordinator.list_events("wide", batch_id=0) if ev["kind"] == "commit_decided")
    assert decision["detail"]["winners"] == [[p, claimed[p].id] for p in sorted(claimed)]
    shown = re.search(r'data-kind="commit_decided".*?<code>([^<]+)</code>', html, re.S).group(1)  # type: ignore[union-attr]
    winners = json.loads(shown.replace("&#34;", '"').replace("&quot;", '"'))["winners"]
    assert winners == decision["detail"]["winners"][:DETAIL_ITEMS] + [f"… {166 - DETAIL_ITEMS} more"]
    assert client.get("/dashboard/sinks/wide/checkpoints/0?lease_state=GONE").status_code == 422
    assert client.get("/dashboard/sinks/wide/checkpoints/0?after=-1").status_code == 422


def test_a_wide_batch_in_flight_draws_the_open_transactions_nearest_their_timeout(
        client: TestClient, api: ProtocolClient, coordinator: Coordinator, clock: ManualClock) -> None:
    gen = new_sink(api, "wide")
    coordinator.begin_checkpoint("wide", 0, gen, "test", partitions=BARS_SHOWN + 10)
    for p in range(BARS_SHOWN + 10):  # every partition's first try claims its pre-lease
        coordinator.lease("wide", 0, 1, gen, p, p)
    clock.advance(seconds=30)
    retry = api.lease("wide", 0, 1, gen, 0, 7)  # partition 0's task again: the youngest transaction
    login(client)
    page = client.get("/dashboard/sinks/wide").text
    drawn = attr(page, "txn-bar", "data-tid")
    assert len(drawn) == BARS_SHOWN and retry["transactional_id"] not in drawn
    assert set(attr(page, "txn-bar", "data-percent")) == {"50.0"}  # 30 s of 60
    assert attr(page, "more-open", "data-count") == ["11"]
    assert f"Open transactions ({BARS_SHOWN + 11})" in page


def test_stuck_offsets_and_lingering_transactions(coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    """The broker watch over the record-only control plane, whose observations the test sets."""
    now = [1000.0]
    watch = BrokerWatch(coordinator, min_stall_s=60, ttl_s=0, watch=PartitionWatch(clock=lambda: now[0]))
    app = FastAPI()
    api_app = create_app(coordinator, admin_token=ADMIN, token_secret=SECRET)
    app.mount("/v1", api_app)  # not needed by the pages; the protocol calls go to api_app directly
    app.mount("/dashboard", create_dashboard(coordinator, admin_token=ADMIN, token_secret=SECRET, broker=watch))
    with TestClient(api_app) as raw, TestClient(app) as t:
        api = ProtocolClient(raw, ADMIN)
        gen = new_sink(api, "orders")
        _, (record,) = batch(api, "orders", gen, 0, [4], commit=False)
        lid = record.lease_id
        kafka.partitions = [PartitionStability("out", 0, high_watermark=50, last_stable_offset=40,
                                               blocking_producer_id=7000 + lid, blocking_producer_epoch=2)]
        kafka.open_transactions = [OpenTransaction("orders-eos-99", 4242, 0, "Ongoing", None, 60_000, (("out", 1),)),
                                   OpenTransaction("orders-eos-0", 7000 + lid, 2, "Ongoing", None, 60_000, (("out", 0),))]
        login(t)
        first = t.get("/dashboard/sinks/orders").text
        assert 'data-testid="no-stuck"' in first  # one observation: cannot tell a stall yet
        assert re.findall(r'<tr class="warn"><td>([^<]+)</td>', first) == ["orders-eos-99"]  # explained one left out
        now[0] += 61
        overview = t.get("/dashboard/").text
        assert attr(overview, "health", "data-level") == ["critical"]
        assert attr(overview, "health", "data-kinds") == ["lingering stuck"]
        page = t.get("/dashboard/sinks/orders").text
        stuck = page.split('data-testid="stuck"')[1].split("</table>")[0]
        assert "out-0" in stuck and ">40<" in stuck and ">50<" in stuck
        assert f"orders-eos-0 (lease {lid}, LEASED" in stuck
        kafka.partitions = [PartitionStability("out", 0, high_watermark=50, last_stable_offset=50)]
        kafka.open_transactions = []
        now[0] += 1
        assert attr(t.get("/dashboard/").text, "health", "data-level") == ["ok"]
    watch.close()


def test_the_overview_observes_every_sinks_broker_at_once(coordinator: Coordinator, kafka: RecordingControlPlane,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A page of several sinks waits for their broker observations together, not one after the
    other (`wait_s` each): here each observation can only finish once all three are under way."""
    from coordinator.service import SinkSpec

    names = ["a", "b", "c"]
    for name in names:
        coordinator.register_sink(SinkSpec(name, f"{name}-eos", "kafka:9092", ["out"]), "admin", check_broker=False)
    all_under_way = threading.Barrier(len(names), timeout=20)
    observe = kafka.partition_stability

    def partition_stability(target: Any, topics: list[str]) -> list[PartitionStability]:
        all_under_way.wait()  # BrokenBarrierError (an observation failure) if the others never start
        return observe(target, topics)

    monkeypatch.setattr(kafka, "partition_stability", partition_stability)
    watch = BrokerWatch(coordinator, wait_s=60)
    try:
        views = watch.views(names)
    finally:
        watch.close()
    assert {name: (v.notes, v.observed_at is not None) for name, v in views.items()} == \
        {name: ([], True) for name in names}


def test_the_broker_watch_threads_end_with_the_app(coordinator: Coordinator) -> None:
    """The dashboard is mounted (Starlette runs no lifespan of a mounted app): the API app's
    lifespan must still shut the dashboard's broker watch down, so no observation thread outlives
    the app."""
    def watch_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("dashboard-broker")}

    before = watch_threads()  # other tests' apps (if they leaked any) are not this test's business
    with TestClient(create_app(coordinator, admin_token=ADMIN, token_secret=SECRET)) as t:
        new_sink(ProtocolClient(t, ADMIN), "orders")
        login(t)
        assert t.get("/dashboard/").status_code == 200  # observes the sink's broker in the watch's pool
        started = watch_threads() - before
        assert started, "the overview started no broker observation thread"
    deadline = time.monotonic() + 30
    while watch_threads() & started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not watch_threads() & started, "broker watch threads still running after the app's shutdown"


@pytest.mark.perf  # a statement count: the cost of a refresh, not what the page shows
def test_the_overview_reads_all_sinks_in_a_fixed_number_of_statements(coordinator: Coordinator) -> None:
    """The overview refreshes every few seconds: its SQL must not grow with the number of sinks.
    Counted on the engine for one render, leaving out the broker watch's own observations (its
    threads, cached for `ttl_s`)."""
    from sqlalchemy import event

    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not threading.current_thread().name.startswith("dashboard-broker"):
            statements.append(statement)

    def render(t: TestClient, sinks: int) -> int:
        t.get("/dashboard/")  # a first render after a change warms the pool and statement caches
        statements.clear()
        event.listen(coordinator.engine, "before_cursor_execute", count)
        try:
            page = t.get("/dashboard/").text
        finally:
            event.remove(coordinator.engine, "before_cursor_execute", count)
        assert len(attr(page, "sink-tile", "data-sink")) == sinks
        return len(statements)

    with TestClient(create_app(coordinator, admin_token=ADMIN, token_secret=SECRET)) as t:
        api = ProtocolClient(t, ADMIN)
        login(t)

        def add_sinks(names: list[str]) -> None:
            for name in names:  # a committed batch and an open one: every part of a tile has rows
                gen = new_sink(api, name)
                batch(api, name, gen, 0, [3, 4])
                batch(api, name, gen, 1, [5], commit=False)

        add_sinks(["s0", "s1"])
        two = render(t, 2)
        add_sinks(["s2", "s3", "s4", "s5"])
        six = render(t, 6)
    assert six <= two + 2, f"{two} statements for 2 sinks, {six} for 6"


def test_names_are_escaped_and_the_wall_screen_flag_sets_large_type(client: TestClient, api: ProtocolClient) -> None:
    new_sink(api, "orders")
    login(client, who="<script>alert(1)</script>")
    page = client.get("/dashboard/").text
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert '<body class=""' in page and 'data-refresh="5"' in page
    assert '<body class="tv"' in client.get("/dashboard/?tv=1").text


def test_a_pruned_batch_says_so_and_leaves_the_charts(client: TestClient, api: ProtocolClient, coordinator: Coordinator,
                                                      clock: ManualClock) -> None:
    gen = new_sink(api, "orders")
    batch(api, "orders", gen, 0, [10, 20])
    batch(api, "orders", gen, 1, [7])
    clock.advance(seconds=2 * 3600)
    assert coordinator.prune_history(timedelta(hours=1), "test").pruned == 1  # batch 0; batch 1 is the newest
    login(client)

    cp = client.get("/dashboard/sinks/orders/checkpoints/0").text
    assert 'data-testid="checkpoint-state">COMMITTED<' in cp
    assert re.findall(r'data-testid="history-pruned">([^<]+)<', cp)[0].startswith("pruned ")
    assert 'data-testid="history-pruned"' not in client.get("/dashboard/sinks/orders/checkpoints/1").text
    page = client.get("/dashboard/sinks/orders").text
    assert re.findall(r'data-batch="(\d+)" data-value="([\d.]+)"', page.split('data-testid="chart-records"')[1]
                      .split("</figure>")[0]) == [("1", "7")]
