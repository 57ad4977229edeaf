"""Real HTTP on loopback against the service in its own processes (uvicorn, as deployed), on a
real Postgres: the `coordinator serve` command with its embedded database, 64 concurrent executors
on one checkpoint, and two service processes sharing one database (replicas behind a load
balancer), including a driver fenced through the other replica."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from sqlalchemy import text

from coordinator.kafka.control_plane import RecordingControlPlane
from coordinator.protocol.errors import ProtocolError
from coordinator.protocol.invariants import Snapshot, check_invariants, check_unchanged
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.store.db import make_engine
from coordinator.store.snapshot import snapshot as read_snapshot
from fixtures.servers import (
    ProtocolClient,
    ServiceProcess,
    Winner,
    clean_env,
    free_port,
    start_services,
    stop_process,
    tail,
    wait_for_http,
)

ADMIN = "process-test-admin-token"
SINK = "events"
PREFIX = "events-eos"
QUERY = "0f4e9a52-query"
V1_PATHS = (
    "/v1/sinks",
    "/v1/sinks/{name}/generations",
    "/v1/sinks/{name}/checkpoints/{batch_id}/begin",
    "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/leases",
    "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/commit",
)


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def launch(database_url: str, tmp_path: Path) -> Iterator[Callable[[int], list[ServiceProcess]]]:
    """Start service processes on the test's database; all are stopped at teardown, and their
    logs printed (pytest shows them when the test failed)."""
    started: list[ServiceProcess] = []

    def start(count: int) -> list[ServiceProcess]:
        services = start_services(database_url, ADMIN, tmp_path, count)
        started.extend(services)
        return services

    yield start
    for s in started:
        if s.alive:
            s.stop()
        print(f"--- {s.name} ({s.url}) log tail ---\n{s.log(40)}")


def snapshot(database_url: str) -> Snapshot:
    engine = make_engine(database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            return read_snapshot(conn)
    finally:
        engine.dispose()


def pool_size(database_url: str) -> int:
    """How many ids the sink's pool holds (it grows on demand)."""
    engine = make_engine(database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT size FROM id_pools")).scalar_one())
    finally:
        engine.dispose()


def run_executors(
    services: Sequence[ServiceProcess],
    token: str,
    batch_id: int,
    attempt: int,
    generation: int,
    tasks: Sequence[tuple[int, int]],
    *,
    records: Callable[[int], int] = lambda p: p + 1,
) -> dict[tuple[int, int], tuple[dict[str, Any], Winner]]:
    """One thread per Spark task attempt (partition, task_attempt_id), all released at once: each
    asks for its lease on one service process and asks again on the other (a retried request after
    a lost answer, spread over the replicas as a load balancer would), which must answer the same
    lease. Returns (partition, task) -> (lease answer, the record the try returns to the driver)."""
    barrier = threading.Barrier(len(tasks))

    def task(i: int, partition: int, task_attempt_id: int) -> tuple[dict[str, Any], Winner]:
        lease_on = services[i % len(services)].client(token)
        retry_on = services[(i + 1) % len(services)].client(token)
        try:
            barrier.wait(30)
            lease = lease_on.lease(SINK, batch_id, attempt, generation, partition, task_attempt_id)
            again = retry_on.lease(SINK, batch_id, attempt, generation, partition, task_attempt_id)
            assert {k: v for k, v in again.items() if k != "age_ms"} == {k: v for k, v in lease.items() if k != "age_ms"}
            # a producer id per task attempt, as InitProducerId would hand out
            return lease, Winner.of(lease, 1_000_000 + task_attempt_id, producer_epoch=partition % 7,
                                    records=records(partition), bytes=100 * records(partition))
        finally:
            lease_on.close()
            retry_on.close()

    with ThreadPoolExecutor(max_workers=len(tasks)) as pool:
        futures = {(p, t): pool.submit(task, i, p, t) for i, (p, t) in enumerate(tasks)}
        return {key: f.result(timeout=120) for key, f in futures.items()}


def assert_services_alive(services: Sequence[ServiceProcess]) -> None:
    for s in services:
        assert s.alive, f"{s.name} died; log:\n{s.log()}"


def error_reason(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text}"
    return resp.json()["error"]["reason"]


# --- (a) the documented serve command -----------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _serve(exe: Path, cwd: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        # no COORDINATOR_* at all: the embedded database and a generated admin token
        return subprocess.Popen(
            [str(exe), "serve", "--port", str(port)], cwd=cwd, env=clean_env(), stdout=out, stderr=subprocess.STDOUT
        )


def test_readme_serve_command(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("coordinator")
    assert exe.is_file() and os.access(exe, os.X_OK), f"console script {exe} is not installed"
    log = tmp_path / "serve.log"
    data = tmp_path / ".coordinator-data"
    postmaster_pids: list[int] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # first start: creates the embedded database and the admin token
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _serve(exe, tmp_path, port, log)
        procs.append(proc)
        wait_for_http(url + "/healthz", proc, log, timeout_s=120)
        spec = httpx.get(url + "/openapi.json", timeout=10).json()
        assert spec["openapi"].startswith("3.")
        for path in V1_PATHS:
            assert path in spec["paths"], path
        docs = httpx.get(url + "/docs", timeout=10)
        assert docs.status_code == 200 and "/openapi.json" in docs.text
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text

        token_file = data / "admin-token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        pid_file = data / "postgres" / "postmaster.pid"
        postmaster_pids.append(int(pid_file.read_text().splitlines()[0]))

        with httpx.Client(base_url=url, timeout=30) as http:
            error_reason(ProtocolClient(http, "guess").register_sink(SINK, PREFIX, expect=None), 403)
            admin = ProtocolClient(http, token)
            registered = admin.register_sink(SINK, PREFIX, check_broker=False, expect=201)  # no Kafka here
            writer = admin.with_token(registered["writer_token"])
            assert writer.start_generation(SINK, QUERY, "run-1")["generation"] == 1

        rc = stop_process(proc)
        assert rc in (0, 128 + signal.SIGTERM), f"exit code {rc}; log:\n{tail(log)}"
        # the embedded Postgres went down with the service
        deadline = time.monotonic() + 15
        while _pid_alive(postmaster_pids[-1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pid_alive(postmaster_pids[-1]), "the embedded Postgres outlived `coordinator serve`"

        # second start in the same directory: same token, same data
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _serve(exe, tmp_path, port, log)
        procs.append(proc)
        wait_for_http(url + "/healthz", proc, log, timeout_s=120)
        assert token_file.read_text().strip() == token
        postmaster_pids.append(int(pid_file.read_text().splitlines()[0]))
        with httpx.Client(base_url=url, timeout=30) as http:
            assert [s["name"] for s in ProtocolClient(http, token).request("GET", "/v1/sinks")] == [SINK]
            writer = ProtocolClient(http, registered["writer_token"])
            assert writer.request("GET", f"/v1/sinks/{SINK}")["generation"] == 1
        rc = stop_process(proc)
        assert rc in (0, 128 + signal.SIGTERM), f"exit code {rc}; log:\n{tail(log)}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for pid in postmaster_pids:  # never leave a database behind, even when the test failed
            if _pid_alive(pid):
                os.kill(pid, signal.SIGQUIT)


# --- (b) 64 executors on one checkpoint --------------------------------------------------------


@pytest.mark.slow
def test_64_concurrent_executors_on_one_checkpoint(launch: Callable[[int], list[ServiceProcess]], database_url: str) -> None:
    services = launch(2)
    admin = services[0].client(ADMIN)
    registered = admin.register_sink(SINK, PREFIX, transaction_timeout_ms=300_000, expect=201)
    token = registered["writer_token"]
    driver = services[0].client(token)
    gen = driver.start_generation(SINK, QUERY, "run-1")["generation"]

    n = 64
    speculative = [p for p in range(n) if p % 8 == 5]  # 8 partitions run twice (spark.speculation)
    tasks = [(p, 1000 + p) for p in range(n)] + [(p, 5000 + p) for p in speculative]

    begun = driver.begin(SINK, 0, gen, partitions=n)
    assert begun["action"] == "write" and begun["attempt"] == 1 and begun["pre_leased"] == n
    pre_leases = {x["partition"]: x["lease_id"] for x in driver.checkpoint(SINK, 0)["leases"]}
    results = run_executors(services, token, 0, 1, gen, tasks)

    leases = {key: lease for key, (lease, _) in results.items()}
    assert len({x["lease_id"] for x in leases.values()}) == len(tasks)
    # every lease is held at once (none resolved before the commit): all ids must differ (I3)
    tids = [x["transactional_id"] for x in leases.values()]
    assert len(set(tids)) == len(tasks), sorted(tids)
    assert all(t.startswith(PREFIX + "-") for t in tids)
    for (p, task_id), lease in leases.items():
        assert (lease["partition"], lease["task_attempt_id"], lease["attempt"], lease["state"]) == (p, task_id, 1, "LEASED")
    # each partition's pre-lease went to exactly one of its tries (the first to ask), the other a fresh id
    for p in range(n):
        claims = [lease for (q, _), lease in leases.items() if q == p and lease["lease_id"] == pre_leases[p]]
        assert len(claims) == 1, (p, claims)
    open_txns = driver.request("GET", f"/v1/sinks/{SINK}/transactions/open")
    assert sorted(x["transactional_id"] for x in open_txns) == sorted(tids)

    # Spark accepted the speculative copy for some partitions, the original for the others
    winners = {p: results[(p, 1000 + p)][1] for p in range(n)}
    for p in speculative[::2]:
        winners[p] = results[(p, 5000 + p)][1]
    chosen = {w.lease_id for w in winners.values()}
    losers = {x["transactional_id"] for x in leases.values() if x["lease_id"] not in chosen}
    assert len(losers) == len(speculative)

    done = driver.commit(SINK, 0, 1, gen, winners)
    assert done["state"] == "COMMITTED" and done["attempt"] == 1
    assert [c["partition"] for c in done["committed"]] == list(range(n))
    assert {c["partition"]: c["lease_id"] for c in done["committed"]} == {p: w.lease_id for p, w in winners.items()}
    assert all(c["records"] == c["partition"] + 1 for c in done["committed"])
    assert set(done["aborted"]) == losers and done["abort_pending"] == []
    assert done["warnings"] == []
    # the driver's retry through the other replica answers the same
    assert services[1].client(token).commit(SINK, 0, 1, gen, winners) == done

    snap = snapshot(database_url)
    assert check_invariants(snap, settled=True) == []
    assert sorted(x.state for x in snap.leases).count("COMMITTED") == n
    assert [x for x in snap.leases if x.state not in ("COMMITTED", "ABORTED")] == []
    assert pool_size(database_url) == len(tasks)  # the pool grew exactly to the concurrency
    # the winners' ids are free at once; the losers' wait out their quarantine
    assert {f"{PREFIX}-{q.ordinal}" for q in snap.quarantines} == losers

    # the next batch, 64 executors again: the pool is reused, not grown
    b1 = driver.begin(SINK, 1, gen, partitions=n)
    assert b1["action"] == "write"
    results = run_executors(services, token, 1, b1["attempt"], gen, [(p, 9000 + p) for p in range(n)])
    tids1 = [lease["transactional_id"] for lease, _ in results.values()]
    assert len(set(tids1)) == n and set(tids1) == set(tids) - losers
    done1 = services[1].client(token).commit(SINK, 1, b1["attempt"], gen, {p: w for (p, _), (_, w) in results.items()})
    assert done1["state"] == "COMMITTED" and len(done1["committed"]) == n

    snap = snapshot(database_url)
    assert check_invariants(snap, settled=True) == []
    assert pool_size(database_url) == len(tasks)
    assert_services_alive(services)


@pytest.mark.slow
def test_pool_grows_under_80_simultaneous_leases(database_url: str) -> None:
    """More simultaneous first-time leases than the pool's retry budget (64): every one must get an
    id. (Regression: concurrent growers raced for the same ordinal; the 65th got pool_exhausted.)
    Driven in-process from threads, because HTTP arrivals are too spread out to reproduce it."""
    n = 80
    engine = make_engine(database_url, pool_size=n)
    coordinator = Coordinator(engine, RecordingControlPlane(), limits=Limits(max_partitions=256))
    try:
        coordinator.register_sink(SinkSpec(SINK, PREFIX, "kafka-1:9092", ["out"]), "admin")
        gen, _ = coordinator.start_generation(SINK, QUERY, "run-1", "driver")
        coordinator.begin_checkpoint(SINK, 0, gen, "driver")
        barrier = threading.Barrier(n)

        def lease(p: int) -> str:
            barrier.wait(30)
            try:
                return coordinator.begin_partition(SINK, 0, 1, gen, p, p).transactional_id
            except ProtocolError as exc:
                return f"refused: {exc.reason}"

        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(lease, range(n)))
        assert sorted(got) == sorted(f"{PREFIX}-{i}" for i in range(n))
        assert check_invariants(coordinator.snapshot()) == []
    finally:
        coordinator.close()
        engine.dispose()


# --- (c) two replicas on one database ---------------------------------------------------------


@pytest.mark.slow
def test_two_service_processes_on_one_database(launch: Callable[[int], list[ServiceProcess]], database_url: str) -> None:
    a, b = services = launch(2)
    registered = a.client(ADMIN).register_sink(SINK, PREFIX, transaction_timeout_ms=300_000, expect=201)
    token = registered["writer_token"]
    # a sink registered on one replica is known to the other, with the same writer token
    assert b.client(ADMIN).register_sink(SINK, PREFIX, transaction_timeout_ms=300_000, expect=200) == registered
    on = {"a": a.client(token), "b": b.client(token)}
    gen1 = on["a"].start_generation(SINK, QUERY, "run-1")["generation"]
    assert on["b"].start_generation(SINK, QUERY, "run-1")["generation"] == gen1  # a retry via the other

    parts = 6
    for batch in range(4):
        first, other = ("a", "b") if batch % 2 == 0 else ("b", "a")
        # no partition count (a client without pre-leases): every try gets an id of its own
        begun = on[first].begin(SINK, batch, gen1)
        assert begun["action"] == "write" and begun["attempt"] == 1
        assert on[other].begin(SINK, batch, gen1) == begun  # the driver's retry lands on the other
        # partition 5 is empty in odd batches: no lease, lease_id null in the commit
        non_empty = range(parts) if batch % 2 == 0 else range(parts - 1)
        tasks = [(p, 100 * batch + p) for p in non_empty]
        if batch == 1:
            tasks.append((0, 100 * batch + 50))  # a speculative copy of partition 0 that loses
        results = run_executors(services, token, batch, 1, gen1, tasks)
        winners: dict[int, Winner | None] = {p: None for p in range(parts)}
        for (p, task_id), (_, record) in results.items():
            if task_id % 100 < 50:
                winners[p] = record

        if batch == 2:
            # the same commit sent to both replicas at the same moment: one decision, same answers
            barrier = threading.Barrier(2)

            def send(name: str) -> dict[str, Any]:
                barrier.wait(10)
                return on[name].commit(SINK, batch, 1, gen1, winners)

            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(send, ("a", "b")))
            assert answers[0] == answers[1]
            done = answers[0]
        else:
            done = on[other].commit(SINK, batch, 1, gen1, winners)
            # the response was lost; the driver retries on the replica it began on
            assert on[first].commit(SINK, batch, 1, gen1, winners) == done
        assert done["state"] == "COMMITTED"
        assert {c["partition"]: c["lease_id"] for c in done["committed"]} == {
            p: w.lease_id for p, w in winners.items() if w is not None
        }
        if batch == 1:
            assert done["aborted"] == [results[(0, 150)][0]["transactional_id"]]
        # a replay of the committed batch is skipped, whichever replica answers
        for name in ("a", "b"):
            replay = on[name].begin(SINK, batch, gen1)
            assert replay["action"] == "skip" and replay["state"] == "COMMITTED"

    # batch 4: the old driver is writing through replica a when the query restarts on replica b
    batch = 4
    assert on["a"].begin(SINK, batch, gen1)["attempt"] == 1
    old = run_executors(services, token, batch, 1, gen1, [(p, 400 + p) for p in range(parts)])
    old_tids = {lease["transactional_id"] for lease, _ in old.values()}
    g2 = on["b"].start_generation(SINK, QUERY, "run-2")
    gen2 = g2["generation"]
    assert gen2 == gen1 + 1
    assert set(g2["aborted"]) == old_tids and g2["abort_pending"] == []

    old_winners: dict[int, Winner | None] = {p: record for (p, _), (_, record) in old.items()}
    before = snapshot(database_url)
    resp = on["a"].commit(SINK, batch, 1, gen1, old_winners, expect=None)
    assert error_reason(resp, 409) == "stale_generation"
    assert resp.json()["error"]["detail"]["current_generation"] == gen2
    assert error_reason(on["b"].commit(SINK, batch, 1, gen1, old_winners, expect=None), 409) == "stale_generation"
    assert error_reason(on["a"].lease(SINK, batch, 1, gen1, 0, 499, expect=None), 409) == "stale_generation"
    # an old try asking for its lease again (its answer was lost) through the other replica
    assert error_reason(on["b"].lease(SINK, batch, 1, gen1, 0, 400, expect=None), 409) == "stale_generation"
    assert error_reason(on["a"].begin(SINK, batch + 1, gen1, expect=None), 409) == "stale_generation"
    assert check_unchanged(before, snapshot(database_url)) == []  # I5: the fenced calls changed nothing

    # the new driver replays batch 4 through replica a and commits through b
    begun = on["a"].begin(SINK, batch, gen2)
    assert begun["action"] == "write" and begun["attempt"] == 2
    assert set(begun["aborted"]) == old_tids
    new = run_executors(services, token, batch, 2, gen2, [(p, 600 + p) for p in range(parts)])
    new_winners: dict[int, Winner | None] = {p: record for (p, _), (_, record) in new.items()}
    done = on["b"].commit(SINK, batch, 2, gen2, new_winners)
    assert done["state"] == "COMMITTED" and done["attempt"] == 2
    assert on["a"].commit(SINK, batch, 2, gen2, new_winners) == done
    # the old driver's late retry is still fenced, after the commit as before it
    assert error_reason(on["a"].commit(SINK, batch, 1, gen1, old_winners, expect=None), 409) == "stale_generation"

    # replica a crashes; b carries on alone
    assert a.kill() == -signal.SIGKILL
    batch = 5
    begun = on["b"].begin(SINK, batch, gen2)
    assert begun["action"] == "write"
    results = run_executors([b], token, batch, begun["attempt"], gen2, [(p, 700 + p) for p in range(parts)])
    done = on["b"].commit(SINK, batch, begun["attempt"], gen2, {p: record for (p, _), (_, record) in results.items()})
    assert done["state"] == "COMMITTED"
    assert_services_alive([b])

    snap = snapshot(database_url)
    assert check_invariants(snap, settled=True) == []
    by_batch = {c.batch_id: c for c in snap.checkpoints}
    assert sorted(by_batch) == list(range(6))
    assert all(c.state == "COMMITTED" for c in snap.checkpoints)
    assert by_batch[4].committed_attempt == 2
    attempts4 = sorted((x for x in snap.attempts if x.checkpoint_id == by_batch[4].id), key=lambda x: x.number)
    assert [(x.state, x.abort_reason) for x in attempts4] == [
        ("ABORTED", "fenced_by_generation_2"), ("COMMITTED", None)
    ]
    # every transaction of batch 4's fenced attempt ended aborted, none committed
    fenced = [x for x in snap.leases if x.attempt_id == attempts4[0].id]
    assert len(fenced) == parts and {x.state for x in fenced} == {"ABORTED"}
