"""The wire control plane's connection to one Kafka cluster: kafka-python's connection manager on
its IO thread, the transaction coordinator lookup (cached per transactional id), and the requests
the control plane sends (EndTxn, InitProducerId and the observations), each answer checked."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import kafka.errors as Errors
from kafka.future import Future
from kafka.net.manager import KafkaConnectionManager
from kafka.net.selector import NetworkSelector
from kafka.protocol.admin.configs import DescribeConfigsRequest
from kafka.protocol.admin.transactions import (
    DescribeProducersRequest,
    DescribeTransactionsRequest,
    ListTransactionsRequest,
)
from kafka.protocol.consumer.offsets import IsolationLevel
from kafka.protocol.metadata import (
    CoordinatorType,
    FindCoordinatorRequest,
    MetadataRequest,
)
from kafka.protocol.producer import (
    EndTxnRequest,
    InitProducerIdRequest,
)

from ..control_plane import (
    OpenTransaction,
    PartitionStability,
    PreparedTransaction,
)
from .errors import _check, _Retry
from .requests import (
    OPEN_STATES,
    UnsupportedByBroker,
    describe_broker_configs_request,
    describe_producers_request,
    list_offsets_request,
    list_transactions_request,
    parse_describe_producers,
    parse_describe_transactions,
    parse_list_offsets,
    parse_list_transactions,
    parse_metadata,
    parse_transaction_max_timeout,
)

# requests in flight per broker connection (kafka-python's default is 5): at least the
# coordinator's kafka_parallelism, so the parallel commits of a checkpoint never wait for a slot
DEFAULT_MAX_IN_FLIGHT = 16
# settings of the kafka-python connection layer a caller may pass (security, sockets, backoff)
_OWN_KEYS = {"bootstrap_servers", "metrics", "metric_group_prefix", "request_timeout_ms"}
_CLIENT_KEYS = (set(KafkaConnectionManager.DEFAULT_CONFIG) | set(NetworkSelector.DEFAULT_CONFIG)) - _OWN_KEYS

log = logging.getLogger(__name__)
T = TypeVar("T")




class _BrokerClient:
    """One kafka-python connection manager (and its IO thread) for one bootstrap string. Safe to
    use from many threads: every request runs as a coroutine on the IO thread, `run` blocks the
    calling thread only."""

    def __init__(self, bootstrap_servers: str, config: dict[str, Any]) -> None:
        self.bootstrap_servers = bootstrap_servers
        self._net = NetworkSelector(**config)
        self._manager = KafkaConnectionManager(self._net, bootstrap_servers=bootstrap_servers, **config)
        self._net.start()
        self._bootstrap_lock = threading.Lock()
        self._coordinators: dict[str, int | str] = {}
        self._coordinators_lock = threading.Lock()
        # kafka-python fails a request at once (NodeNotReadyError) when its connection already has
        # max_in_flight_requests_per_connection outstanding; calls wait here for a slot instead
        self.slots = threading.BoundedSemaphore(int(config.get("max_in_flight_requests_per_connection", 5)))
        self.closed = False

    def ensure_bootstrapped(self, timeout_ms: int) -> None:
        """Bootstrap once for every caller, within `timeout_ms` of this caller's time, waiting for
        another caller's bootstrap included: 16 calls queued behind each other's timed-out tries
        took 16 timeouts each, far past their retry budget."""
        if self._manager.bootstrapped:
            return
        deadline = time.monotonic() + timeout_ms / 1000
        if not self._bootstrap_lock.acquire(timeout=timeout_ms / 1000):
            raise _Retry("broker_unreachable", f"cannot bootstrap from {self.bootstrap_servers}: another call's "
                                               f"bootstrap did not end within {timeout_ms} ms")
        try:
            if self._manager.bootstrapped:
                return
            self._manager.bootstrap(max(100, int((deadline - time.monotonic()) * 1000)))
        except Errors.KafkaError as exc:
            raise _Retry("broker_unreachable", f"cannot bootstrap from {self.bootstrap_servers}: {exc}") from exc
        finally:
            self._bootstrap_lock.release()

    def run(self, coro: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._manager.run(coro, *args)

    # --- on the IO thread: what a pass's coroutine (passes.py) runs its calls with ---------------

    async def all_of(self, calls: Iterable[Callable[[], Awaitable[None]]]) -> None:
        """Run the calls concurrently on the IO thread (awaited from it) until every one ended."""
        futures = []
        for call in calls:
            future: Future = Future()

            async def run(call: Callable[[], Awaitable[None]] = call, future: Future = future) -> None:
                try:
                    future.success(await call())
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    future.failure(exc)

            self._net.call_soon(run)
            futures.append(future)
        for future in futures:
            await future

    async def take_slot(self, timeout_ms: int) -> None:
        """One of the connection's request slots (`slots`, shared with the calling threads), waiting
        on the IO thread's timers, never blocking it: a slot is missing only while other callers fill
        the connection."""
        deadline = time.monotonic() + timeout_ms / 1000
        delay = 0.001
        while not self.slots.acquire(blocking=False):
            if time.monotonic() >= deadline:
                raise _Retry("request_timed_out", f"no request slot on the connection within {timeout_ms} ms")
            await self._net.sleep(delay)
            delay = min(delay * 2, 0.02)

    def forget_coordinator(self, transactional_id: str) -> None:
        with self._coordinators_lock:
            self._coordinators.pop(transactional_id, None)

    async def _send(self, request: Any, node_id: int | str | None, timeout_ms: int) -> Any:
        future = self._manager.send(request, node_id=node_id, request_timeout_ms=timeout_ms)
        # the connection's own timer only starts once the request is written; bound the wait for
        # a connection that is still being set up too
        return await self._manager.wait_for(future, timeout_ms + 500)

    async def coordinator(self, transactional_id: str, timeout_ms: int) -> int | str:
        """Node id of the transaction coordinator of this transactional id (cached)."""
        with self._coordinators_lock:
            known = self._coordinators.get(transactional_id)
        if known is not None:
            return known
        versions = self._manager.broker_version_data
        batched = versions is not None and versions.api_version(FindCoordinatorRequest) >= 4
        if batched:
            request = FindCoordinatorRequest(
                key_type=CoordinatorType.TRANSACTION.value, coordinator_keys=[transactional_id], min_version=4
            )
        else:
            request = FindCoordinatorRequest(
                key=transactional_id, key_type=CoordinatorType.TRANSACTION.value, max_version=3
            )
        response = await self._send(request, None, timeout_ms)
        if batched:
            found = [c for c in response.coordinators if c.key == transactional_id]
            if not found:
                raise _Retry("coordinator_not_available", f"FindCoordinator answered no row for {transactional_id!r}")
            answer = found[0]
        else:
            answer = response
        _check(answer.error_code, f"FindCoordinator({transactional_id!r})")
        node_id = self._manager.cluster.add_coordinator(
            answer, CoordinatorType.TRANSACTION, transactional_id, synthesize_node_id=False
        )
        with self._coordinators_lock:
            self._coordinators[transactional_id] = node_id
        return node_id

    async def end_txn(self, txn: PreparedTransaction, committed: bool, max_version: int, timeout_ms: int) -> Any:
        node = await self.coordinator(txn.transactional_id, timeout_ms)
        request = EndTxnRequest(
            transactional_id=txn.transactional_id,
            producer_id=txn.producer_id,
            producer_epoch=txn.producer_epoch,
            committed=committed,
            max_version=max_version,
        )
        return await self._send(request, node, timeout_ms)

    async def init_producer_id(self, transactional_id: str, transaction_timeout_ms: int, timeout_ms: int) -> Any:
        node = await self.coordinator(transactional_id, timeout_ms)
        request = InitProducerIdRequest(
            transactional_id=transactional_id,
            transaction_timeout_ms=transaction_timeout_ms,
            producer_id=-1,  # no expected producer: fence whoever holds the id
            producer_epoch=-1,
            max_version=5,  # v6 adds KIP-939 two-phase-commit fields, not used here
        )
        return await self._send(request, node, timeout_ms)

    # --- observations -----------------------------------------------------------------------

    @property
    def api_versions(self) -> dict[int, tuple[int, int]] | None:
        versions = self._manager.broker_version_data
        return None if versions is None else dict(versions.api_versions)

    def api_version(self, request_cls: Any) -> int | None:
        """The version both sides speak, None if the broker does not offer the API."""
        versions = self._manager.broker_version_data
        if versions is None:
            return None
        try:
            return int(versions.api_version(request_cls))
        except Errors.IncompatibleBrokerVersion:
            return None

    def require(self, request_cls: Any) -> int:
        version = self.api_version(request_cls)
        if version is None:
            raise UnsupportedByBroker(request_cls.API_KEY)
        return version

    def brokers(self) -> list[Any]:
        return sorted(self._manager.cluster.brokers(), key=lambda b: b.node_id)

    async def connect(self, node_id: int, timeout_ms: int) -> None:
        """Open (or reuse) the connection to a broker at its advertised address."""
        conn = self._manager.get_connection(node_id, timeout_ms=timeout_ms)
        await self._manager.wait_for(conn.init_future, timeout_ms + 500)

    async def request(self, request: Any, node_id: int | None, timeout_ms: int) -> Any:
        return await self._send(request, node_id, timeout_ms)

    async def list_transactions(self, node_id: int, states: Iterable[str], prefix: str, timeout_ms: int) -> list[tuple[str, int, str]]:
        version = self.require(ListTransactionsRequest)
        response = await self._send(list_transactions_request(states, prefix, version), node_id, timeout_ms)
        return parse_list_transactions(response, prefix)

    async def open_transactions(self, prefix: str, timeout_ms: int) -> list[OpenTransaction]:
        """ListTransactions (not completed states) on every broker -- each is the transaction
        coordinator of some ids -- then DescribeTransactions for the ids under prefix on the
        broker that listed them."""
        self.require(ListTransactionsRequest)
        self.require(DescribeTransactionsRequest)
        found: dict[str, OpenTransaction] = {}
        for broker in self.brokers():
            listed = await self.list_transactions(broker.node_id, OPEN_STATES, prefix, timeout_ms)
            if not listed:
                continue
            request = DescribeTransactionsRequest(transactional_ids=[tid for tid, _, _ in listed])
            for txn in parse_describe_transactions(await self._send(request, broker.node_id, timeout_ms)):
                found[txn.transactional_id] = txn
        return [found[k] for k in sorted(found)]

    async def stability(self, topics: list[str], timeout_ms: int) -> list[PartitionStability]:
        """Metadata -> leaders; per leader ListOffsets(LATEST) at READ_UNCOMMITTED (high watermark)
        and READ_COMMITTED (last stable offset); DescribeProducers on the leaders of partitions
        whose LSO is below the HW, to name the producer holding it (best effort)."""
        request = MetadataRequest(topics=[MetadataRequest.MetadataRequestTopic(name=t) for t in topics],
                                  allow_auto_topic_creation=False)
        layout = parse_metadata(await self._send(request, None, timeout_ms), topics)
        by_leader: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for topic, partitions in layout.items():
            for partition, leader in partitions:
                by_leader[leader].append((topic, partition))
        high: dict[tuple[str, int], int] = {}
        stable: dict[tuple[str, int], int] = {}
        for leader, tps in sorted(by_leader.items()):
            for isolation, into in ((IsolationLevel.READ_UNCOMMITTED, high), (IsolationLevel.READ_COMMITTED, stable)):
                into.update(parse_list_offsets(await self._send(list_offsets_request(tps, isolation), leader, timeout_ms)))
        blocked = {tp for tp in high if stable.get(tp, high[tp]) < high[tp]}
        blocking: dict[tuple[str, int], tuple[int, int, int]] = {}
        if blocked and self.api_version(DescribeProducersRequest) is not None:
            for leader, tps in sorted(by_leader.items()):
                wanted = [tp for tp in tps if tp in blocked]
                if not wanted:
                    continue
                try:
                    named, refused = parse_describe_producers(
                        await self._send(describe_producers_request(wanted), leader, timeout_ms))
                except (Errors.KafkaError, OSError) as exc:
                    log.warning("DescribeProducers on broker %s failed: %s", leader, exc)
                    continue
                blocking.update(named)
                if refused:
                    log.warning("DescribeProducers on broker %s refused %s", leader, refused)
        result = []
        for tp in sorted(high):
            pid, epoch, start = blocking.get(tp, (None, None, None))
            result.append(PartitionStability(tp[0], tp[1], high[tp], stable[tp], pid, epoch, start))
        return result

    async def transaction_max_timeout(self, node_id: int, timeout_ms: int) -> int | None:
        self.require(DescribeConfigsRequest)
        response = await self._send(describe_broker_configs_request(node_id), node_id, timeout_ms)
        return parse_transaction_max_timeout(response)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._manager.close()
        finally:
            self._net.stop(timeout_ms=5_000)
