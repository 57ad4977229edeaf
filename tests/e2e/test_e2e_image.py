"""`coordinator serve` in the built image, for real (`-m e2e`, Podman or Docker like
tests/e2e/test_e2e_compose.py), on docker-compose.yml's one-broker stack:

- the rollout test (tests/deploy/test_deploy_rollout.py) on the image: a replica started before the
  migration is alive (the image's own HEALTHCHECK passes) but not ready (/readyz 503
  schema_not_current, so compose's health check fails), and ready once the `migrate` service --
  the same image with `migrate` -- has run; the database is then at the migrations' head;
- /metrics is scraped from every replica (and through the balancer's published port): the
  recovery loop runs and exactly one replica leads it;
- a rolling restart (SIGTERM, start, ready; one replica after the other) while the example job
  writes through the balancer loses nothing: the job finishes without a restart and the
  read_committed verifier passes.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from dockerfile_parse import DockerfileParser
from fixtures.compose_stack import Stack, no_engine, output_dir, selected_engine
from fixtures.deploy_config import REPO_ROOT
from fixtures.servers import free_port

TOTAL_RECORDS = 1500
REPLICAS = ("coordinator-1", "coordinator-2")

_NO_ENGINE = no_engine()

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(_NO_ENGINE is not None, reason=f"compose e2e suite: {_NO_ENGINE}"),
]


@pytest.fixture
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    engine = selected_engine(request, "tests/e2e/test_e2e_image.py")
    out_dir = output_dir("image")
    port = free_port()
    env = {**engine.env, "TOTAL_RECORDS": str(TOTAL_RECORDS),
           "PUBLISHED_PORT": str(port), "E2E_PORT": str(port), "E2E_OUT": str(out_dir)}
    s = Stack(engine, f"eos-image-{uuid.uuid4().hex[:6]}", ("docker-compose.yml",), env)
    try:
        yield s
    finally:
        logs = s.compose("logs", "--timestamps", check=False, timeout=300)
        (out_dir / "compose.log").write_text(logs.stdout + logs.stderr)
        s.down()


def image_healthcheck() -> list[str]:
    """The image's HEALTHCHECK command (exec form), as the Dockerfile states it."""
    value = next(i["value"] for i in DockerfileParser(str(REPO_ROOT / "Dockerfile")).structure
                 if i["instruction"] == "HEALTHCHECK")
    return json.loads(value[value.index("CMD") + 3:].strip())


def http_in(s: Stack, service: str, path: str) -> tuple[int, str]:
    """GET http://127.0.0.1:8000{path} from inside the service's container: (status, body)."""
    code = ("import urllib.request, urllib.error, sys\n"
            "try:\n r = urllib.request.urlopen('http://127.0.0.1:8000%s', timeout=5); print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n print(e.code); print(e.read().decode())\n" % path)
    proc = s.exec(service, "python", "-c", code)
    assert proc.returncode == 0, proc.stderr
    status, _, body = proc.stdout.partition("\n")
    return int(status), body


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def job_batches(s: Stack) -> int:
    return s.cli("logs", s.container("spark-job"), check=False).stdout.count("[example_job] batch=")


@pytest.mark.timeout(1800)
def test_the_image_serves_migrates_reports_and_rolls_without_loss(stack: Stack) -> None:
    s = stack
    s.build()
    for service in ("postgres", "kafka"):
        s.up(service)
        s.wait_healthy(service)

    # a replica before the migration: alive, not ready
    s.compose("up", "-d", "--no-deps", "coordinator-1")
    deadline = time.monotonic() + 120
    while s.exec("coordinator-1", *image_healthcheck()).returncode != 0:
        assert time.monotonic() < deadline, "the image's HEALTHCHECK never passed"
        time.sleep(2)
    status, body = http_in(s, "coordinator-1", "/readyz")
    assert status == 503 and json.loads(body)["error"]["reason"] == "schema_not_current", body
    assert not s.healthy("coordinator-1")  # compose's check (/readyz): no traffic yet

    # the migration: the same image with `migrate`; then the database is at the head revision
    s.up("migrate")
    s.wait_completed("migrate")
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    head = ScriptDirectory.from_config(cfg).get_current_head()
    stored = s.exec("postgres", "psql", "-U", "coordinator", "-d", "coordinator", "-tAc",
                    "select version_num from alembic_version").stdout.strip()
    assert stored == head, (stored, head)
    s.wait_healthy("coordinator-1", timeout_s=60)
    s.started |= {"coordinator-1", "migrate"}
    s.up("coordinator")  # the second replica and the balancer
    s.wait_healthy("coordinator")

    # /metrics from every replica and through the published port: one recovery leader
    deadline = time.monotonic() + 90
    while True:
        scraped = {r: http_in(s, r, "/metrics") for r in REPLICAS}
        assert all(code == 200 for code, _ in scraped.values())
        leaders = [metric(text, "coordinator_recovery_leader") for _, text in scraped.values()]
        iterations = [metric(text, "coordinator_recovery_iterations_total") or 0 for _, text in scraped.values()]
        if sum(x or 0 for x in leaders) == 1 and sum(iterations) > 0:
            break
        assert time.monotonic() < deadline, f"leaders {leaders}, iterations {iterations}"
        time.sleep(3)
    published = httpx.get(f"http://127.0.0.1:{s.env['E2E_PORT']}/metrics", timeout=10)
    assert published.status_code == 200 and "coordinator_recovery_leader" in published.text

    # a rolling restart while the job writes: nothing lost
    s.up("kafka-init")
    s.wait_completed("kafka-init")
    s.up("spark-job")
    deadline = time.monotonic() + 300
    while job_batches(s) < 2:
        assert s.status("spark-job")[0] == "running", "the job stopped before its second batch"
        assert time.monotonic() < deadline, "no batch within 300 s"
        time.sleep(2)
    for replica in REPLICAS:
        s.cli("stop", "-t", "30", s.container(replica))  # SIGTERM: uvicorn drains, then exits
        time.sleep(3)  # traffic meanwhile goes to the other replica
        s.start(replica)
        s.wait_healthy(replica, timeout_s=120)
    before = job_batches(s)
    while (st := s.status("spark-job"))[0] != "exited":
        assert time.monotonic() < deadline + 600, "the job did not finish"
        time.sleep(2)
    assert st[1] == 0, s.cli("logs", s.container("spark-job"), check=False).stdout[-3000:]
    assert job_batches(s) > before, "no batch was written after the rolling restart"
    verified = s.compose("run", "--rm", "--no-deps", "verifier", check=False, timeout=600)
    assert verified.returncode == 0 and "PASS" in verified.stdout, verified.stdout + verified.stderr
