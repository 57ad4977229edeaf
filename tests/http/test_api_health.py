"""Liveness, readiness and the OpenAPI document's routes (routes/health.py, api.py), in-process."""

from __future__ import annotations

from fastapi.testclient import TestClient

from coordinator.http.api import create_app
from coordinator.service import Coordinator
from coordinator.store.db import make_engine
from fixtures.api_app import ADMIN, SECRET, error_of, http  # noqa: F401 - fixtures


def test_openapi_lists_the_v1_routes(http: TestClient) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    attempt = "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}"
    expected = {
        "/v1/sinks": {"get", "post"},
        "/v1/sinks/{name}": {"get"},
        "/v1/sinks/{name}/writer-token": {"post"},
        "/v1/sinks/{name}/retire": {"post"},
        "/v1/sinks/{name}/generations": {"post"},
        "/v1/sinks/{name}/lineage/reset": {"post"},
        "/v1/sinks/{name}/lost-data/acknowledge": {"post"},
        "/v1/sinks/{name}/checkpoints": {"get"},
        "/v1/sinks/{name}/checkpoints/{batch_id}": {"get"},
        "/v1/sinks/{name}/checkpoints/{batch_id}/begin": {"post"},
        f"{attempt}/leases": {"post"},
        f"{attempt}/commit": {"post"},
        f"{attempt}/abort": {"post"},
        "/v1/sinks/{name}/checkpoints/{batch_id}/resume": {"post"},
        "/v1/sinks/{name}/transactions/open": {"get"},
        "/v1/sinks/{name}/events": {"get"},
        "/v1/sinks/{name}/broker-check": {"post"},
        "/v1/sinks/{name}/partitions": {"get"},
        "/v1/history/prune": {"post"},
        "/healthz": {"get"},
        "/readyz": {"get"},
        "/metrics": {"get"},
    }
    assert set(paths) == set(expected)  # no pre-commit route: a winner's record comes with the commit
    for path, methods in expected.items():
        assert methods == set(paths[path]), (path, set(paths[path]))
    commit = paths[f"{attempt}/commit"]["post"]
    assert {"401", "403", "404", "409", "422"} <= set(commit["responses"])
    record = http.get("/openapi.json").json()["components"]["schemas"]["PartitionResultBody"]["properties"]
    assert {"task_attempt_id", "producer_id", "producer_epoch", "records", "bytes"} <= set(record)


def test_readyz(http: TestClient) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    resp = http.get("/readyz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ready", "kafka_control_plane": "none"}


def test_readyz_without_a_database() -> None:
    dead = Coordinator(make_engine("postgresql://nobody@127.0.0.1:1/nothing", pool_size=1), None)
    try:
        with TestClient(create_app(dead, admin_token=ADMIN, token_secret=SECRET)) as client:
            error_of(client.get("/readyz"), 503, "database_unavailable")
            assert client.get("/healthz").status_code == 200
    finally:
        dead.close()
