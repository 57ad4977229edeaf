"""The server as deployed (`coordinator serve --workers 2`, real uvicorn, real Postgres) answers
back-to-back requests on one keep-alive connection without the ~40 ms delayed-ACK stall.

With --workers > 1 uvicorn binds the socket itself and shares it with its workers; on asyncio's
loop the accepted connections then get no TCP_NODELAY, so a response's second write waits for the
client's delayed ACK (40 ms on Linux). The serve command pins uvloop + httptools, which set it. The
probe is checked against that broken configuration too, so it is known to catch the stall."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fixtures.servers import REPO_ROOT, clean_env, free_port, stop_process, wait_for_http

# latency bounds (a 40 ms stall against a 20 ms bound): a performance-shape check, out of the default run
pytestmark = pytest.mark.perf

ADMIN = "keepalive-test-admin-token"
REQUESTS = 20
# a stalled response takes >= 40 ms; an unstalled /healthz on loopback well under 5 ms, so 20 ms
# leaves room for a busy machine and is still half of what a stall costs
BOUND_MS = 20.0


def _keepalive_median_ms(url: str) -> float:
    """Median time of REQUESTS sequential GETs on one keep-alive connection (after a first one)."""
    with httpx.Client(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1), timeout=10) as client:
        client.get(url).raise_for_status()
        times = []
        for _ in range(REQUESTS):
            t0 = time.perf_counter()
            client.get(url).raise_for_status()
            times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def _serve(cmd: list[str], database_url: str, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = clean_env(
        COORDINATOR_DATABASE_URL=database_url,
        COORDINATOR_ADMIN_TOKEN=ADMIN,
        COORDINATOR_KAFKA_CONTROL_PLANE="none",
        COORDINATOR_RECOVERY_ENABLED="false",
        COORDINATOR_LOG_LEVEL="warning",
    )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/healthz"
    wait_for_http(url, proc, log_path)
    return proc, url


def test_serve_with_two_workers_does_not_stall_keepalive_requests(database_url: str, tmp_path: Path) -> None:
    proc, url = _serve(
        [sys.executable, "-m", "coordinator.cli", "serve", "--host", "127.0.0.1", "--workers", "2"],
        database_url, tmp_path / "serve.log",
    )
    try:
        median = _keepalive_median_ms(url)
    finally:
        stop_process(proc)
    assert median < BOUND_MS, f"keep-alive requests take {median:.1f} ms each (a delayed-ACK stall?)"


def test_the_probe_catches_the_stall_of_asyncio_with_two_workers(database_url: str, tmp_path: Path) -> None:
    """The broken variant: uvicorn on asyncio + h11 with 2 workers, the same app."""
    proc, url = _serve(
        [sys.executable, "-m", "uvicorn", "coordinator.app:create_app_from_env", "--factory", "--host", "127.0.0.1",
         "--workers", "2", "--loop", "asyncio", "--http", "h11", "--log-level", "warning"],
        database_url, tmp_path / "broken.log",
    )
    try:
        median = _keepalive_median_ms(url)
    finally:
        stop_process(proc)
    assert median > 2 * BOUND_MS * 0.75, f"expected the ~40 ms stall on asyncio with 2 workers, got {median:.1f} ms"
