"""Test helpers: the real coordinator service as a subprocess, and a small sync protocol client.

`ServiceProcess` runs `python -m uvicorn coordinator.app:create_app_from_env --factory` on
127.0.0.1 and a free port, configured only through COORDINATOR_* environment variables (record-only
Kafka control plane), and keeps its log in a file so a failing test can show it.

`ProtocolClient` wraps any `httpx.Client` (a real one against a subprocess, or FastAPI's
TestClient in-process) with one method per protocol call. Each method asserts the expected status
and returns the decoded JSON; pass `expect=None` to get the raw `httpx.Response` instead.

`scripted_http` is a real HTTP server answering from a `Script`: for answers the coordinator never
gives (a proxy's error or login page, a redirect, another version's answer).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**overrides: str | None) -> dict[str, str]:
    """The current environment without any COORDINATOR_* variable, plus overrides (None drops)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDINATOR_")}
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "<no log>"
    return "\n".join(text.splitlines()[-lines:])


def wait_for_http(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 60.0) -> httpx.Response:
    """Poll `url` until it answers 200; fail early (with the log) if the process exits."""
    deadline = time.monotonic() + timeout_s
    last: str = "no attempt"
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise AssertionError(f"process exited with {code} before {url} answered; log:\n{tail(log_path)}")
        try:
            resp = httpx.get(url, timeout=2.0)
            if resp.status_code == 200:
                return resp
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s} s (last: {last}); log:\n{tail(log_path)}")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> int:
    """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"process {proc.pid} ignored SIGTERM for {timeout_s} s and was killed") from None
    return proc.returncode


class ServiceProcess:
    """One uvicorn process serving the coordinator over a given database."""

    def __init__(
        self,
        database_url: str,
        admin_token: str,
        log_dir: Path,
        *,
        name: str = "coordinator",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.database_url = database_url
        self.admin_token = admin_token
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"{name}-{self.port}.log"
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServiceProcess:
        """Start the process (returns at once; call `wait_ready`)."""
        assert self.proc is None, "already started"
        env = clean_env(**{  # extra_env may override the defaults (e.g. a real Kafka control plane)
            "COORDINATOR_DATABASE_URL": self.database_url,
            "COORDINATOR_ADMIN_TOKEN": self.admin_token,
            "COORDINATOR_KAFKA_CONTROL_PLANE": "none",
            **self.extra_env,
        })
        cmd = [
            sys.executable, "-m", "uvicorn", "coordinator.app:create_app_from_env", "--factory",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "info",
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> ServiceProcess:
        assert self.proc is not None, "not started"
        wait_for_http(self.url + "/healthz", self.proc, self.log_path, timeout_s)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, lines: int = 80) -> str:
        return tail(self.log_path, lines)

    def stop(self, timeout_s: float = 20.0) -> int:
        """Graceful stop (SIGTERM); returns the exit code."""
        assert self.proc is not None, "not started"
        return stop_process(self.proc, timeout_s)

    def kill(self) -> int:
        """Crash stop (SIGKILL); returns the exit code (-9)."""
        assert self.proc is not None, "not started"
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(10)

    def client(self, token: str | None = None, timeout_s: float = 30.0) -> ProtocolClient:
        # plain HTTP on loopback: skip building a TLS context (20 ms of CPU per client)
        return ProtocolClient(httpx.Client(base_url=self.url, timeout=timeout_s, verify=False), token)

    def __enter__(self) -> ServiceProcess:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        if self.alive:
            self.stop()


def start_services(
    database_url: str, admin_token: str, log_dir: Path, count: int, **kwargs: Any
) -> list[ServiceProcess]:
    """Start `count` processes in parallel and wait until all answer /healthz."""
    services = [
        ServiceProcess(database_url, admin_token, log_dir, name=f"coordinator-{chr(ord('a') + i)}", **kwargs)
        for i in range(count)
    ]
    try:
        for s in services:
            s.start()
        for s in services:
            s.wait_ready()
    except BaseException:
        for s in services:
            if s.alive:
                s.kill()
        raise
    return services


# --- protocol client -------------------------------------------------------------------------

Expect = int | Iterable[int] | None


class ProtocolClient:
    """Sync client for REST API v1 on any httpx.Client (TestClient included)."""

    def __init__(self, http: httpx.Client, token: str | None = None) -> None:
        self.http = http
        self.token = token

    def with_token(self, token: str | None) -> ProtocolClient:
        """The same connection, another bearer token."""
        return ProtocolClient(self.http, token)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, body: Any = None, *, expect: Expect = 200, **kwargs: Any) -> Any:
        headers = dict(kwargs.pop("headers", {}) or {})
        if self.token is not None:
            headers.setdefault("Authorization", f"Bearer {self.token}")
        resp = self.http.request(method, path, json=body, headers=headers, **kwargs)
        if expect is None:
            return resp
        allowed = {expect} if isinstance(expect, int) else set(expect)
        if resp.status_code not in allowed:
            raise AssertionError(
                f"{method} {path} {body!r}: expected HTTP {sorted(allowed)}, got {resp.status_code}: {resp.text}"
            )
        return resp.json()

    # --- sinks (admin) ----------------------------------------------------------------------

    def register_sink(
        self,
        name: str,
        prefix: str,
        *,
        bootstrap_servers: str = "kafka-1:9092",
        topics: Iterable[str] = ("out",),
        expect: Expect = (200, 201),
        **extra: Any,
    ) -> Any:
        body = {
            "name": name,
            "transactional_id_prefix": prefix,
            "bootstrap_servers": bootstrap_servers,
            "topics": list(topics),
            **extra,
        }
        return self.request("POST", "/v1/sinks", body, expect=expect)

    def rotate_writer_token(self, sink: str, *, expect: Expect = 200) -> Any:
        return self.request("POST", f"/v1/sinks/{sink}/writer-token", expect=expect)

    def reset_lineage(self, sink: str, reason: str = "new checkpoint location", *, expect: Expect = 200) -> Any:
        return self.request("POST", f"/v1/sinks/{sink}/lineage/reset", {"reason": reason}, expect=expect)

    # --- protocol (driver and executors) ----------------------------------------------------

    def start_generation(self, sink: str, query_id: str, run_id: str, *, expect: Expect = 200) -> Any:
        return self.request(
            "POST", f"/v1/sinks/{sink}/generations", {"query_id": query_id, "run_id": run_id}, expect=expect
        )

    def begin(self, sink: str, batch_id: int, generation: int, *, expect: Expect = 200) -> Any:
        return self.request(
            "POST", f"/v1/sinks/{sink}/checkpoints/{batch_id}/begin", {"generation": generation}, expect=expect
        )

    def lease(
        self,
        sink: str,
        batch_id: int,
        attempt: int,
        generation: int,
        partition: int,
        task_attempt_id: int,
        *,
        expect: Expect = 200,
    ) -> Any:
        body = {"generation": generation, "partition": partition, "task_attempt_id": task_attempt_id}
        return self.request(
            "POST", f"/v1/sinks/{sink}/checkpoints/{batch_id}/attempts/{attempt}/leases", body, expect=expect
        )

    def precommit(
        self,
        sink: str,
        lease_id: int,
        generation: int,
        producer_id: int,
        producer_epoch: int = 0,
        records: int = 10,
        bytes: int = 1000,  # noqa: A002 - the API's field name
        *,
        expect: Expect = 200,
    ) -> Any:
        body = {
            "generation": generation,
            "producer_id": producer_id,
            "producer_epoch": producer_epoch,
            "records": records,
            "bytes": bytes,
        }
        return self.request("POST", f"/v1/sinks/{sink}/leases/{lease_id}/precommit", body, expect=expect)

    def commit(
        self,
        sink: str,
        batch_id: int,
        attempt: int,
        generation: int,
        winners: Mapping[int, int | None],
        *,
        expect: Expect = 200,
    ) -> Any:
        """`winners`: partition -> winning lease id (None for an empty partition)."""
        body = {
            "generation": generation,
            "partitions": [{"partition": p, "lease_id": lid} for p, lid in sorted(winners.items())],
        }
        return self.request(
            "POST", f"/v1/sinks/{sink}/checkpoints/{batch_id}/attempts/{attempt}/commit", body, expect=expect
        )

    def abort(
        self, sink: str, batch_id: int, attempt: int, generation: int | None, reason: str = "test", *, expect: Expect = 200
    ) -> Any:
        body: dict[str, Any] = {"reason": reason}
        if generation is not None:
            body["generation"] = generation
        return self.request(
            "POST", f"/v1/sinks/{sink}/checkpoints/{batch_id}/attempts/{attempt}/abort", body, expect=expect
        )

    def checkpoint(self, sink: str, batch_id: int, *, expect: Expect = 200) -> Any:
        return self.request("GET", f"/v1/sinks/{sink}/checkpoints/{batch_id}", expect=expect)


class Script:
    """What a scripted HTTP server answers: (status, body, headers) in order, the last one repeated."""

    def __init__(self, *answers: tuple[int, str, dict[str, str]]) -> None:
        self.answers = list(answers)
        self.requests: list[str] = []


@contextlib.contextmanager
def scripted_http() -> Iterator[tuple[str, Script]]:
    """A real HTTP server on localhost answering from a Script: for answers the coordinator does not
    give on purpose (a proxy's 5xx or login page, a redirect, an answer of another version)."""
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            script.requests.append(f"{self.command} {self.path}")
            status, body, headers = script.answers.pop(0) if len(script.answers) > 1 else script.answers[0]
            payload = body.encode()
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", script
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
