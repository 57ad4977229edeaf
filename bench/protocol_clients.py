"""The protocol benchmark's clients: the protocol's calls made in process (on `Coordinator`) or over
HTTP (to `coordinator serve`), the sinks they write to, and the server as deployed.

Both clients speak the rebuilt coordinator's protocol and, for bench/compare_checkouts.py, the one
before it (main at 99d89b6: begin answered the pre-leases' ids, a record carried no
task_attempt_id). Which one a coordinator speaks is read from it, never configured."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import pydantic_core

ROOT = Path(__file__).resolve().parent.parent


class Rejected(Exception):
    """A protocol call answered with an error (counted by reason, the run goes on)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class Begun(NamedTuple):
    attempt: int | None  # None: the batch is already committed
    pre_leased: int  # partitions whose first try's id begin took
    # (partition, lease id, transactional id) of each pre-lease, when begin names them (the code
    # before the rebuild: its first tries write without a lease call)
    pre_leases: list[tuple[int, int, str]]


class Granted(NamedTuple):
    lease_id: int
    transactional_id: str


class Record(NamedTuple):
    """A task try's pre-commit record, with the figures and first offsets the writer's executor
    reports: one [topic, partition, offset] per topic-partition its transaction wrote."""

    task_attempt_id: int
    producer_id: int
    producer_epoch: int
    records: int
    write_ms: int | None = None
    first_offsets: list[list[Any]] | None = None


class InprocessSink:
    def __init__(self, coordinator: Any, name: str) -> None:
        self.c = coordinator
        self.name = name
        self.actor = f"writer:{name}"
        # the rebuilt coordinator: every try asks for its lease, a record names its try
        self.claims = hasattr(coordinator, "lease")

    def start_generation(self, query_id: str, run_id: str) -> int:
        gen, _ = self.c.start_generation(self.name, query_id, run_id, self.actor)
        return gen

    def begin(self, batch_id: int, generation: int, partitions: int | None = None) -> Begun:
        extra = {} if partitions is None else {"partitions": partitions}
        r = self.c.begin_checkpoint(self.name, batch_id, generation, self.actor, **extra)
        if not r.must_write:
            return Begun(None, 0, [])
        named = [(x.partition, x.id, x.transactional_id) for x in getattr(r, "pre_leases", [])]
        return Begun(r.attempt.number, getattr(r, "pre_leased", len(named)), named)

    def lease(self, batch_id: int, attempt: int, generation: int, partition: int, task_attempt_id: int) -> Granted:
        lease = self.c.begin_partition(self.name, batch_id, attempt, generation, partition, task_attempt_id)
        return Granted(lease.id, lease.transactional_id)

    def commit(self, batch_id: int, attempt: int, generation: int, winners: list[tuple[int, int]],
               records: list[Record]) -> int:
        """Name the winners, each with its pre-commit record; the number of winners committed."""
        from coordinator.protocol.model import PartitionResult, PrecommitRecord

        claims = self.claims

        def record(r: Record) -> Any:
            fields = (r.producer_id, r.producer_epoch, r.records, r.records * 100, r.write_ms, r.first_offsets)
            return PrecommitRecord(r.task_attempt_id, *fields) if claims else PrecommitRecord(*fields)

        results = [PartitionResult(p, lid, record(r)) for (p, lid), r in zip(winners, records)]
        return len(self.c.commit(self.name, batch_id, attempt, generation, results, self.actor).winners)


class HttpSink:
    """One keep-alive HTTP/1.1 connection per calling thread, spoken on a plain socket: the load
    generator shares the 2 cores with the server, so every millisecond of its CPU is one the
    server does not get. Each request's head is the same but for its path and length, and an
    answer is read by its Content-Length (uvicorn answers every call so); bodies are encoded and
    parsed by pydantic's core (cheaper than the standard library's http.client and json: see
    NOTEBOOK.md)."""

    def __init__(self, base_url: str, name: str, token: str) -> None:
        import urllib.parse

        self.name = name
        parts = urllib.parse.urlsplit(base_url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._path = f"/v1/sinks/{name}"
        self._head = (f"Host: {self._host}:{self._port}\r\nAuthorization: Bearer {token}\r\n"
                      "Content-Type: application/json\r\n").encode()
        self._local = threading.local()
        self._connections: list[socket.socket] = []
        self._claims: bool | None = None

    def _connection(self) -> tuple[socket.socket, bytearray]:
        c = getattr(self._local, "connection", None)
        if c is None:
            s = socket.create_connection((self._host, self._port), timeout=120.0)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = self._local.connection = (s, bytearray())
            self._connections.append(s)
        return c

    def _exchange(self, request: bytes) -> tuple[int, bytes, bool]:
        """Status, body and whether the server keeps the connection open."""
        s, buffer = self._connection()
        s.sendall(request)
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            if not (chunk := s.recv(65536)):
                raise ConnectionError("the server closed the connection")
            buffer += chunk
        head = bytes(buffer[:end]).lower()
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        start = end + 4
        while len(buffer) < start + length:
            if not (chunk := s.recv(max(65536, start + length - len(buffer)))):
                raise ConnectionError("the server closed the connection")
            buffer += chunk
        body = bytes(buffer[start:start + length])
        del buffer[:start + length]
        return int(head[9:12]), body, b"connection: close" not in head

    def _request(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        request = b"".join((f"{method} {path} HTTP/1.1\r\n".encode(), self._head,
                            b"Content-Length: %d\r\n\r\n" % len(body or b""), body or b""))
        for attempt in (0, 1):
            try:
                status, answer, keep = self._exchange(request)
            except ConnectionError:
                # the server closed an idle keep-alive connection as we reused it (uvicorn's 5 s
                # keep-alive timeout): protocol calls are safe to retry, as the writer's client does
                self._drop()
                if attempt:
                    raise
                continue
            if not keep:
                self._drop()
            return status, answer
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        c = getattr(self._local, "connection", None)
        if c is not None:
            c[0].close()
            self._local.connection = None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, raw = self._request("POST", self._path + path, pydantic_core.to_json(body))
        if status >= 300:
            try:
                err = pydantic_core.from_json(raw)["error"]
                raise Rejected(err.get("reason", str(status)), err.get("message", raw.decode(errors="replace")))
            except (ValueError, KeyError, TypeError):
                raise Rejected(f"http_{status}", raw[:300].decode(errors="replace")) from None
        answer: dict[str, Any] = pydantic_core.from_json(raw)
        return answer

    @property
    def claims(self) -> bool:
        """Whether the server is the rebuilt coordinator (begin answers a pre-lease count, a record
        names its try), read once from its OpenAPI document."""
        if self._claims is None:
            _, raw = self._request("GET", "/openapi.json", None)
            schema = pydantic_core.from_json(raw)
            self._claims = "pre_leased" in schema["components"]["schemas"]["BeginOut"]["properties"]
        return self._claims

    def close(self) -> None:
        for c in self._connections:
            c.close()

    def start_generation(self, query_id: str, run_id: str) -> int:
        return self._post("/generations", {"query_id": query_id, "run_id": run_id})["generation"]

    def begin(self, batch_id: int, generation: int, partitions: int | None = None) -> Begun:
        body: dict[str, Any] = {"generation": generation}
        if partitions is not None:
            body["partitions"] = partitions
        r = self._post(f"/checkpoints/{batch_id}/begin", body)
        if r["action"] != "write":
            return Begun(None, 0, [])
        named = [(x["partition"], x["lease_id"], x["transactional_id"]) for x in r.get("pre_leases", [])]
        return Begun(r["attempt"], r.get("pre_leased", len(named)), named)

    def lease(self, batch_id: int, attempt: int, generation: int, partition: int, task_attempt_id: int) -> Granted:
        body = {"generation": generation, "partition": partition, "task_attempt_id": task_attempt_id}
        r = self._post(f"/checkpoints/{batch_id}/attempts/{attempt}/leases", body)
        return Granted(r["lease_id"], r["transactional_id"])

    def commit(self, batch_id: int, attempt: int, generation: int, winners: list[tuple[int, int]],
               records: list[Record]) -> int:
        parts = [{"partition": p, "lease_id": lid} for p, lid in winners]
        claims = self.claims
        for part, r in zip(parts, records):
            if claims:
                part["task_attempt_id"] = r.task_attempt_id
            part.update(producer_id=r.producer_id, producer_epoch=r.producer_epoch, records=r.records,
                        bytes=r.records * 100, write_ms=r.write_ms, first_offsets=r.first_offsets)
        body = {"generation": generation, "partitions": parts}
        return len(self._post(f"/checkpoints/{batch_id}/attempts/{attempt}/commit", body)["committed"])


# --- sinks, server ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KafkaSide:
    """Where a run's sinks write when the coordinator runs the real control plane."""

    bootstrap: str
    topic: str
    topic_partitions: int


def sink_names(tag: str, mode: str, partitions: int, drivers: int) -> list[str]:
    # fixed-width numbers: no prefix may start another sink's prefix
    return [f"bench-{tag}-{mode}-{partitions}p-d{i:04d}" for i in range(drivers)]


def register_inprocess(url: str, names: list[str]) -> list[dict[str, str]]:
    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.service import Coordinator, SinkSpec
    from coordinator.store.db import make_engine

    engine = make_engine(url, pool_size=2)
    c = Coordinator(engine, RecordingControlPlane(keep_history=False))
    try:
        for n in names:
            c.register_sink(SinkSpec(name=n, transactional_id_prefix=f"tx-{n}", bootstrap_servers="localhost:9092",
                                     topics=["bench"]), "admin")
    finally:
        c.close()
        engine.dispose()
    return [{"name": n} for n in names]


def register_http(base_url: str, admin_token: str, names: list[str],
                  kafka: KafkaSide | None = None) -> list[dict[str, str]]:
    import httpx

    bootstrap, topic = (kafka.bootstrap, kafka.topic) if kafka else ("localhost:9092", "bench")
    out = []
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=120) as c:
        for n in names:
            r = c.post("/v1/sinks", json={"name": n, "transactional_id_prefix": f"tx-{n}",
                                          "bootstrap_servers": bootstrap, "topics": [topic]})
            r.raise_for_status()
            out.append({"name": n, "token": r.json()["writer_token"]})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`coordinator serve` (the production entry point: migrate, then uvicorn with --workers) in a
    subprocess of its own process group, from the checkout `code` (default: this one), with the
    record-only Kafka control plane ("none") or the real one ("kafka"), and any further settings
    as environment variables."""

    def __init__(self, url: str, workers: int, pool_size: int, log_level: str, log_path: Path, *,
                 control_plane: str = "none", code: Path = ROOT, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.admin_token = secrets.token_urlsafe(24)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("COORDINATOR_")}
        environ.update({
            "COORDINATOR_DATABASE_URL": url,
            "COORDINATOR_ADMIN_TOKEN": self.admin_token,
            "COORDINATOR_KAFKA_CONTROL_PLANE": control_plane,
            "COORDINATOR_DB_POOL_SIZE": str(pool_size),
            "COORDINATOR_LOG_LEVEL": log_level,
            "PYTHONPATH": str(code),
            **(env or {}),
        })
        self.log_file = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", str(workers)],
            env=environ, cwd=str(code), stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.log_path = log_path
        # uvicorn logs each worker's "Application startup complete" at info
        self._wait_ready(workers if log_level in ("debug", "info") else 0)

    def _wait_ready(self, workers: int) -> None:
        """Until /readyz answers, then until the log shows `workers` workers started."""
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator serve exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError(f"coordinator serve not ready after 120 s; see {self.log_path}")
        deadline = time.monotonic() + 60
        while self.log_path.read_bytes().count(b"Application startup complete") < workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{workers} workers of coordinator serve not started after 60 s; see {self.log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_group(self.proc)
        self.log_file.close()


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group a benchmark started (by its id), SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
