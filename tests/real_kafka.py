"""pytest fixtures on a real Apache Kafka (localkafka/: Kafka's own server jars, resolved by Maven).

One single-node KRaft broker per transaction version, each started once per test session and only
when a test asks for it:

- `kafka_tv2`: formatted with `transaction.version=2` (Kafka 4.x's default, KIP-890);
- `kafka_tv1`: formatted with `transaction.version=1`;
- `kafka_each_tv`: a test that takes it runs once on each;
- `real_kafka`: the default (TV2).

Every broker has a SASL/SCRAM listener (user `alice`), Kafka's ACL authorizer (the plain listener's
ANONYMOUS principal is a super user, so only the SASL listener is subject to ACLs), and a listener
advertised through a fault proxy (`RealKafka.proxy`, `proxied_bootstrap`) for lost answers,
delays and injected error codes in front of the real broker.

Every test that takes one of these fixtures is marked `real_kafka` (conftest.py), so
`pytest -m real_kafka` runs exactly the tests a real broker judges.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kafka_proxy import KafkaFaultProxy
from localkafka import LocalKafka

SCRAM_USER, SCRAM_PASSWORD = "alice", "alice-secret"
FIXTURES = ("kafka_tv1", "kafka_tv2", "kafka_each_tv", "real_kafka", "kafka_faults")


@dataclass
class RealKafka:
    """A running single-node cluster and the fault proxy in front of its proxied listener."""

    cluster: LocalKafka
    proxy: KafkaFaultProxy

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap_servers

    @property
    def proxied_bootstrap(self) -> str:
        return self.cluster.proxied_bootstrap_servers

    @property
    def sasl_bootstrap(self) -> str:
        return self.cluster.sasl_bootstrap_servers

    @property
    def transaction_version(self) -> int:
        return self.cluster.transaction_version

    def create_topic(self, partitions: int = 1, name: str | None = None, **config: str) -> str:
        from confluent_kafka.admin import AdminClient, NewTopic

        name = name or f"t-{uuid.uuid4().hex[:10]}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        admin.create_topics([NewTopic(name, partitions, 1, config=config)])[name].result(30)
        return name

    def read_committed(self, topic: str, timeout_s: float = 30.0) -> list[Any]:
        return read_committed(self.bootstrap, topic, timeout_s)


def read_committed(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[Any]:
    """Every record a `read_committed` consumer sees in `topic`, up to each partition's last stable
    offset (confluent-kafka messages, in partition then offset order)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"verify-{uuid.uuid4().hex[:8]}",
        "isolation.level": "read_committed", "enable.auto.commit": False, "enable.partition.eof": True,
        "log_level": 0,
    })
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        partitions = sorted(metadata.topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        pending, out = set(partitions), []
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic}: partitions {sorted(pending)} did not reach their end within "
                                     f"{timeout_s} s (an open transaction holds the last stable offset?)")
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition())
                    continue
                raise AssertionError(f"{topic}: {msg.error()}")
            out.append(msg)
        return sorted(out, key=lambda m: (m.partition(), m.offset()))
    finally:
        consumer.close()


def _start(tmp_path_factory: pytest.TempPathFactory, transaction_version: int) -> Iterator[RealKafka]:
    cluster = LocalKafka(tmp_path_factory.mktemp(f"kafka-tv{transaction_version}"),
                         transaction_version=transaction_version, scram_users={SCRAM_USER: SCRAM_PASSWORD},
                         authorizer=True, proxy_listener=True)
    node = cluster.nodes[0]
    assert node.advertised_proxy_port is not None and node.proxied_port is not None
    proxy = KafkaFaultProxy(node.advertised_proxy_port, node.proxied_port)
    try:
        cluster.start()
        yield RealKafka(cluster, proxy)
    finally:
        proxy.close()
        cluster.stop()


@pytest.fixture(scope="session")
def kafka_tv2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealKafka]:
    yield from _start(tmp_path_factory, 2)


@pytest.fixture(scope="session")
def kafka_tv1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealKafka]:
    yield from _start(tmp_path_factory, 1)


@pytest.fixture(params=[1, 2], ids=["tv1", "tv2"])
def kafka_each_tv(request: pytest.FixtureRequest) -> RealKafka:
    """The test runs once against a broker of each transaction version."""
    return request.getfixturevalue(f"kafka_tv{request.param}")


@pytest.fixture
def real_kafka(kafka_tv2: RealKafka) -> RealKafka:
    return kafka_tv2


@pytest.fixture
def kafka_faults(real_kafka: RealKafka) -> Iterator[RealKafka]:
    """The default broker with its proxy cleared of earlier tests' faults (clients must bootstrap
    from `proxied_bootstrap` for the faults to apply)."""
    real_kafka.proxy.clear()
    real_kafka.proxy.release()
    yield real_kafka
    real_kafka.proxy.clear()
    real_kafka.proxy.release()
