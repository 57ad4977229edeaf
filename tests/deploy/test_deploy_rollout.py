"""How a deployed replica starts, with a real `coordinator serve` process on a real Postgres and
the health checks exactly as the image and the compose file run them: with
COORDINATOR_MIGRATE_ON_START=false (what compose and Kubernetes set) a replica on an unmigrated
database is alive (/healthz, so the liveness probe and the image's HEALTHCHECK do not kill it) but
not ready (/readyz 503 schema_not_current, so no traffic and no rollout progress) until
`coordinator migrate` -- the migrate service's and the migration Job's command -- has run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from fixtures.deploy_config import REPO_ROOT, load_compose
from dockerfile_parse import DockerfileParser
from fixtures.servers import clean_env, free_port, stop_process, wait_for_http

from coordinator.store.db import sqlalchemy_url


@pytest.fixture
def empty_database_url(postgres_server_url: str) -> Iterator[str]:
    """A database with nothing in it: a fresh install before its first migration."""
    from sqlalchemy.engine import make_url

    name = f"fresh_{uuid.uuid4().hex[:10]}"
    plain = postgres_server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield make_url(sqlalchemy_url(postgres_server_url)).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def image_healthcheck() -> list[str]:
    """The coordinator image's HEALTHCHECK command (exec form)."""
    value = next(i["value"] for i in DockerfileParser(str(REPO_ROOT / "Dockerfile")).structure
                 if i["instruction"] == "HEALTHCHECK")
    cmd = json.loads(value[value.index("CMD") + 3:].strip())
    assert cmd[0] == "python"
    return [sys.executable, *cmd[1:]]


def compose_readiness_check(port: int) -> list[str]:
    """The compose replicas' health check, pointed at this test's port instead of 8000."""
    test = load_compose("docker-compose.yml")["services"]["coordinator-1"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"]
    return [sys.executable, *(part.replace(":8000/", f":{port}/") for part in test[2:])]


def exit_code(cmd: list[str], env: dict[str, str]) -> int:
    return subprocess.run(cmd, env=env, capture_output=True, timeout=30).returncode


def test_an_unmigrated_replica_is_alive_but_not_ready_until_migrate_runs(empty_database_url: str, tmp_path: Path) -> None:
    port = free_port()
    env = clean_env(
        COORDINATOR_DATABASE_URL=empty_database_url,
        COORDINATOR_ADMIN_TOKEN="rollout-admin",
        COORDINATOR_KAFKA_CONTROL_PLANE="none",
        COORDINATOR_HOST="127.0.0.1",
        COORDINATOR_PORT=str(port),
        COORDINATOR_MIGRATE_ON_START="false",
    )
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve"], cwd=REPO_ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/healthz", proc, log_path, timeout_s=90)
        assert exit_code(image_healthcheck(), env) == 0  # the image's HEALTHCHECK: alive
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["error"]["reason"] == "schema_not_current"
        assert exit_code(compose_readiness_check(port), env) != 0  # compose keeps nginx waiting
        assert "COORDINATOR_MIGRATE_ON_START=false: not migrating" in log_path.read_text()

        # the migration Job / compose `migrate` service: the same image, `migrate`, only the URL
        migrate_env = clean_env(COORDINATOR_DATABASE_URL=empty_database_url)
        done = subprocess.run([sys.executable, "-m", "coordinator.cli", "migrate"], cwd=REPO_ROOT, env=migrate_env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 30
        while exit_code(compose_readiness_check(port), env) != 0:
            assert time.monotonic() < deadline, "not ready after the migration"
            time.sleep(0.5)
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        assert exit_code(image_healthcheck(), env) == 0
    finally:
        code = stop_process(proc)
    assert code in (0, 143), code
    # and with nothing listening the image's health check fails
    assert exit_code(image_healthcheck(), env) != 0
