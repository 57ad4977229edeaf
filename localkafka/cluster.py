"""A real Apache Kafka on loopback: one KRaft node, or three (the cluster of Kafka's own
transactions system test: replication 3, min ISR 2), from Kafka's server jars (localkafka/maven.py).

Each node runs broker and controller in one JVM (`process.roles=broker,controller`), with a static
quorum (`controller.quorum.voters`); storage is formatted by Kafka's StorageTool with the chosen
`transaction.version` (1: Kafka 3.x transactions; 2: KIP-890, an epoch bump at every transaction
end). Optional: a SASL/SCRAM listener beside the plain one (users created at format time) and
Kafka's ACL authorizer (the plain listener's ANONYMOUS principal stays a super user), and a
listener that advertises another port, for a fault proxy in front of the broker.

    with LocalKafka(tmp_dir, nodes=3, transaction_version=1) as kafka:
        kafka.bootstrap_servers          # "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
        kafka.node(2).kill(); kafka.node(2).start()

Nodes started attached (the default) are killed by the kernel when the process that started them
dies (PR_SET_PDEATHSIG), so a crashed test run leaves no broker behind; `detach=True` (the command
line's `start`) keeps them running until `stop`, which reads the pids from `cluster.json`.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .maven import default_kafka_version, kafka_classpath

STATE_FILE = "cluster.json"
SUPER_USER = "admin"  # SCRAM user that is a super user when the authorizer is on

# Broker settings for a loopback test cluster; each is Kafka's default unless said otherwise.
BASE_CONFIG: dict[str, Any] = {
    "group.initial.rebalance.delay.ms": 0,  # consumers join at once (default 3 s)
    # fewer internal partitions than Kafka's 50: they are created at first use, on 2 cores
    "transaction.state.log.num.partitions": 10,
    "offsets.topic.num.partitions": 10,
    # act on timed-out transactions within ~1 s of their timeout (default every 10 s), so tests
    # of the broker's own timeout do not wait
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": 1000,
    "num.network.threads": 2,
    "num.io.threads": 4,
    "log.dirs": None,  # set per node
}



def new_cluster_id() -> str:
    """A random cluster id as Kafka's own Uuid.randomUuid makes it: URL-safe base64 of 16 random
    bytes, never starting with "-" (the storage tool's argument parser would take it for a flag,
    1 run in 64)."""
    while True:
        candidate = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not candidate.startswith("-") and uuid.UUID(bytes=base64.urlsafe_b64decode(candidate + "==")).int:
            return candidate

class LocalKafkaError(RuntimeError):
    """A node did not start, or the directory holds another cluster; the message says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it exits (Linux)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class KafkaNode:
    """One KRaft node (broker + controller in one JVM)."""

    cluster: LocalKafka = field(repr=False)
    node_id: int
    port: int
    controller_port: int
    sasl_port: int | None = None
    # a listener that advertises another port (a fault proxy's, which forwards to proxied_port)
    proxied_port: int | None = None
    advertised_proxy_port: int | None = None
    pid: int | None = None
    log_offset: int = 0  # where this start's output begins in the log
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def directory(self) -> Path:
        return self.cluster.directory / f"node-{self.node_id}"

    @property
    def log_path(self) -> Path:
        return self.directory / "kafka.log"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and _pid_alive(self.pid)

    def start(self) -> None:
        """Start the node's JVM (after a stop or kill, with its data as it was)."""
        if self.alive:
            return
        c = self.cluster
        out = open(self.log_path, "ab")
        self.log_offset = out.tell()
        self.proc = subprocess.Popen(
            ["java", *c.jvm_options, "-cp", os.pathsep.join(c.classpath), "kafka.Kafka",
             str(self.directory / "server.properties")],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=c.detach, preexec_fn=None if c.detach else _die_with_parent,
        )
        out.close()
        self.pid = self.proc.pid
        c._save_state()

    def kill(self) -> None:
        """SIGKILL: a crash, no controlled shutdown."""
        self.signal(signal.SIGKILL)
        self.wait_exit(10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (a controlled shutdown), SIGKILL after timeout_s."""
        self.signal(signal.SIGTERM)
        if not self.wait_exit(timeout_s):
            self.kill()

    def signal(self, sig: int) -> None:
        if self.pid is not None and self.alive:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def wait_exit(self, timeout_s: float) -> bool:
        """True once the node's process is gone (reaped, if this process started it)."""
        deadline = time.monotonic() + timeout_s
        while self.alive:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def properties(self) -> dict[str, Any]:
        c = self.cluster
        listeners = [f"PLAINTEXT://127.0.0.1:{self.port}", f"CONTROLLER://127.0.0.1:{self.controller_port}"]
        advertised = [f"PLAINTEXT://127.0.0.1:{self.port}"]
        protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
        props: dict[str, Any] = {
            **BASE_CONFIG,
            "process.roles": "broker,controller",
            "node.id": self.node_id,
            "controller.quorum.voters": ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in c.nodes),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.directory / "data"),
            "offsets.topic.replication.factor": c.replication,
            "transaction.state.log.replication.factor": c.replication,
            "transaction.state.log.min.isr": c.min_isr,
            "default.replication.factor": c.replication,
            "min.insync.replicas": c.min_isr,
        }
        if self.sasl_port is not None:
            listeners.append(f"SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}")
            advertised.append(f"SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}")
            protocols.append("SASL_PLAINTEXT:SASL_PLAINTEXT")
            props["sasl.enabled.mechanisms"] = "SCRAM-SHA-256"
            props["listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config"] = (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;")
        if self.proxied_port is not None:
            listeners.append(f"PROXIED://127.0.0.1:{self.proxied_port}")
            advertised.append(f"PROXIED://127.0.0.1:{self.advertised_proxy_port}")
            protocols.append("PROXIED:PLAINTEXT")
        if c.authorizer:
            props["authorizer.class.name"] = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
            # the plain listener (tests' own clients, the controllers) keeps every right
            props["super.users"] = f"User:ANONYMOUS;User:{SUPER_USER}"
        props["listeners"] = ",".join(listeners)
        props["advertised.listeners"] = ",".join(advertised)
        props["listener.security.protocol.map"] = ",".join(protocols)
        props.update(c.broker_config)
        return props


class LocalKafka:
    """A KRaft cluster of `nodes` nodes in `directory` (see the module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        nodes: int = 1,
        version: str | None = None,
        transaction_version: int = 2,
        ports: list[int] | None = None,
        scram_users: Mapping[str, str] | None = None,
        authorizer: bool = False,
        broker_config: Mapping[str, Any] | None = None,
        heap: str = "768m",
        detach: bool = False,
        proxy_listener: bool = False,
    ) -> None:
        if nodes < 1:
            raise ValueError("nodes must be at least 1")
        if transaction_version not in (1, 2):
            raise ValueError("transaction_version must be 1 or 2")
        if ports is not None and len(ports) != nodes:
            raise ValueError(f"give one port per node ({nodes})")
        self.directory = Path(directory).resolve()
        self.version = version
        self.transaction_version = transaction_version
        self.scram_users = dict(scram_users or {})
        if authorizer and self.scram_users and SUPER_USER not in self.scram_users:
            self.scram_users[SUPER_USER] = "admin-secret"
        self.authorizer = authorizer
        self.broker_config = dict(broker_config or {})
        self.detach = detach
        self.replication = min(nodes, 3)
        self.min_isr = 2 if nodes >= 3 else 1
        self.jvm_options = [f"-Xms128m", f"-Xmx{heap}", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
                            "-Dorg.slf4j.simpleLogger.showDateTime=true"]
        self.cluster_id = new_cluster_id()
        self.classpath: list[str] = []
        self.nodes = [
            KafkaNode(self, i + 1, (ports[i] if ports else free_port()), free_port(),
                      free_port() if self.scram_users else None)
            for i in range(nodes)
        ]
        if proxy_listener:
            for n in self.nodes:
                n.proxied_port, n.advertised_proxy_port = free_port(), free_port()

    # --- the cluster ---------------------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes)

    @property
    def sasl_bootstrap_servers(self) -> str:
        if not self.scram_users:
            raise LocalKafkaError("this cluster has no SASL listener (give scram_users)")
        return ",".join(f"127.0.0.1:{n.sasl_port}" for n in self.nodes)

    @property
    def proxied_bootstrap_servers(self) -> str:
        """The proxy listener's advertised addresses: a client bootstrapping here is told to reach
        every broker through its proxy (each listening on advertised_proxy_port and forwarding to
        proxied_port)."""
        if self.nodes[0].proxied_port is None:
            raise LocalKafkaError("this cluster has no proxy listener (give proxy_listener=True)")
        return ",".join(f"127.0.0.1:{n.advertised_proxy_port}" for n in self.nodes)

    def node(self, node_id: int) -> KafkaNode:
        return self.nodes[node_id - 1]

    def start(self, timeout_s: float = 120.0) -> LocalKafka:
        """Resolve the jars, format fresh storage, start every node, wait until all have started."""
        if (self.directory / STATE_FILE).exists():
            running = [p for p in json.loads((self.directory / STATE_FILE).read_text()).get("pids", []) if _pid_alive(p)]
            if running:
                raise LocalKafkaError(f"{self.directory} already holds a running cluster (pids {running}): "
                                      "stop it first (python -m localkafka stop)")
        if shutil.which("java") is None:
            raise LocalKafkaError("Kafka needs Java 17 on PATH (Debian: apt-get install -y openjdk-17-jre-headless)")
        self.version = self.version or default_kafka_version()
        self.classpath = kafka_classpath(self.version)
        shutil.rmtree(self.directory, ignore_errors=True)
        for n in self.nodes:
            n.directory.mkdir(parents=True, exist_ok=True)
            _write_properties(n.directory / "server.properties", n.properties())
            self._format(n)
        for n in self.nodes:
            n.start()
        self.wait_ready(timeout_s)
        return self

    def _format(self, node: KafkaNode) -> None:
        cmd = ["java", "-Xmx256m", "-cp", os.pathsep.join(self.classpath), "kafka.tools.StorageTool", "format",
               f"--cluster-id={self.cluster_id}", "-c", str(node.directory / "server.properties"),
               "--feature", f"transaction.version={self.transaction_version}"]
        for user, password in sorted(self.scram_users.items()):
            cmd += ["--add-scram", f"SCRAM-SHA-256=[name={user},password={password}]"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise LocalKafkaError(f"formatting node {node.node_id} failed:\n{(done.stdout + done.stderr)[-2000:]}")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every node has started (a KRaft broker logs it once it is registered and has
        caught up with the cluster's metadata) and accepts connections."""
        deadline = time.monotonic() + timeout_s
        for n in self.nodes:
            while True:
                if not n.alive:
                    raise LocalKafkaError(f"Kafka node {n.node_id} exited; its log ({n.log_path}):\n{n.log_tail()}")
                if _started(n):
                    break
                if time.monotonic() > deadline:
                    raise LocalKafkaError(f"Kafka node {n.node_id} did not answer within {timeout_s:.0f} s; "
                                          f"its log ({n.log_path}):\n{n.log_tail()}")
                time.sleep(0.2)

    def stop(self, *, keep_data: bool = False) -> None:
        """Stop every node (controlled shutdown, then SIGKILL) and remove the data unless asked."""
        for n in self.nodes:  # all at once: a node left alone without a quorum cannot shut down
            n.signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for n in self.nodes:
            if not n.wait_exit(max(0.0, deadline - time.monotonic())):
                n.kill()
        if not keep_data:
            shutil.rmtree(self.directory, ignore_errors=True)
        elif (self.directory / STATE_FILE).exists():
            self._save_state()

    def __enter__(self) -> LocalKafka:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the state file (for `python -m localkafka stop|status` from another process) ----------

    def _save_state(self) -> None:
        state = {
            "version": self.version,
            "transaction_version": self.transaction_version,
            "cluster_id": self.cluster_id,
            "bootstrap_servers": self.bootstrap_servers,
            "sasl_bootstrap_servers": self.sasl_bootstrap_servers if self.scram_users else None,
            "nodes": [{"id": n.node_id, "port": n.port, "controller_port": n.controller_port,
                       "sasl_port": n.sasl_port, "pid": n.pid} for n in self.nodes],
            "pids": [n.pid for n in self.nodes if n.pid is not None and n.alive],
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.directory / STATE_FILE)

    @classmethod
    def attach(cls, directory: str | Path) -> LocalKafka:
        """The cluster recorded in directory (started by another process)."""
        path = Path(directory) / STATE_FILE
        if not path.exists():
            raise LocalKafkaError(f"no cluster in {Path(directory).resolve()} ({STATE_FILE} missing)")
        state = json.loads(path.read_text())
        cluster = cls(directory, nodes=len(state["nodes"]), version=state["version"],
                      transaction_version=state["transaction_version"], detach=True,
                      ports=[n["port"] for n in state["nodes"]])
        cluster.cluster_id = state["cluster_id"]
        for node, recorded in zip(cluster.nodes, state["nodes"]):
            node.controller_port, node.sasl_port, node.pid = recorded["controller_port"], recorded["sasl_port"], recorded["pid"]
        return cluster

    def status(self) -> list[tuple[KafkaNode, bool]]:
        return [(n, n.alive) for n in self.nodes]


def _write_properties(path: Path, props: Mapping[str, Any]) -> None:
    lines = [f"{k}={'true' if v is True else 'false' if v is False else v}" for k, v in props.items() if v is not None]
    path.write_text("\n".join(lines) + "\n")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its parent) is not alive
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _started(node: KafkaNode) -> bool:
    """The node logged that it started (since its last start) and accepts connections."""
    try:
        with open(node.log_path, "rb") as f:
            f.seek(node.log_offset)
            if b"Kafka Server started" not in f.read():
                return False
        socket.create_connection(("127.0.0.1", node.port), timeout=1).close()
        return True
    except OSError:
        return False
