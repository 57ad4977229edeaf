"""The real Kafka control plane: resume-commit and abort on Kafka's wire protocol (DESIGN.md §3
step 5, §4), with kafka-python's protocol classes and connection manager (no hand-written wire
encoding).

commit(target, txn)
    FindCoordinator(key_type=TRANSACTION, key=transactional id) -> the transaction coordinator,
    then EndTxn(transactional_id, producer_id, producer_epoch, committed=True) sent there. This is
    what Flink's `FlinkKafkaInternalProducer.resumeTransaction` arranges by reflection (it sets
    the producer's transactional id, `producerIdAndEpoch`, moves the transaction manager to
    IN_TRANSACTION and marks the transaction started, so that `commitTransaction()` sends exactly
    this FindCoordinator + EndTxn). Here the two requests are sent directly, from a process that
    never produced a record.

abort(target, transactional_id)
    InitProducerId(transactional_id, transaction_timeout_ms). The broker bumps the id's epoch,
    which fences every producer still holding it, and aborts an ongoing transaction. Kafka answers
    CONCURRENT_TRANSACTIONS while it writes the abort markers (and while a previous EndTxn is
    still completing); the request is repeated until the broker answers NONE, which it only does
    once no transaction of the id is open any more.

Errors
    Retried with exponential backoff (and jitter) inside a bounded total time, then raised as
    `ControlPlaneError(retriable=True)`: COORDINATOR_NOT_AVAILABLE and NOT_COORDINATOR (the
    cached coordinator is dropped and found again), COORDINATOR_LOAD_IN_PROGRESS,
    CONCURRENT_TRANSACTIONS, REQUEST_TIMED_OUT, NETWORK_EXCEPTION, any other error kafka-python
    marks retriable, connection failures, client-side request timeouts, an unreachable bootstrap.
    Raised at once as `ControlPlaneError(retriable=False, code=<snake_case Kafka error name>)`:
    PRODUCER_FENCED and INVALID_PRODUCER_EPOCH (a newer producer initialised the id, or the broker
    aborted the transaction at its timeout and bumped the epoch: Kafka has no separate "timed out"
    answer, a timed-out transaction is refused as fenced), INVALID_TXN_STATE (nothing to commit:
    the transaction was empty, or was aborted at the same epoch), INVALID_PRODUCER_ID_MAPPING and
    UNKNOWN_PRODUCER_ID (the id has another producer id, or the broker does not know the id),
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED and other authorization failures,
    INVALID_TRANSACTION_TIMEOUT, TRANSACTION_ABORTABLE, and any code not known to be transient.

Retried commits are idempotent
    EndTxn is only ever sent with v0-v4 (`end_txn_max_version=4`), which Kafka treats as a
    transaction-version-1 client whatever `transaction.version` the cluster finalized (Kafka's
    `TransactionVersion.transactionVersionForEndTxn`: only v5+ is TV2). Under those rules a
    completed commit keeps its producer id and epoch, and `EndTxn(commit)` repeated with the same
    id and epoch is answered NONE (`endTransactionWithTV1`: CompleteCommit + COMMIT -> NONE;
    PrepareCommit + COMMIT -> CONCURRENT_TRANSACTIONS, retried until NONE). So a commit whose
    response was lost, or a second finisher (driver resume vs. recovery loop), sees success. The
    retry stops being recognisable only if the id is initialised again after the commit (the epoch
    moves on and the retry is PRODUCER_FENCED); the coordinator never re-leases an id before its
    lease is recorded COMMITTED, so that cannot happen to a commit it still has to finish.

    KIP-890 transaction version 2 (`end_txn_max_version=5`): every EndTxn completion bumps the
    epoch, and the response (v5) carries the new producer id and epoch. A retry of the same
    commit must then carry the epoch the transaction *ran* at (the one librdkafka reports while
    the transaction is open, which is what is stored at pre-commit): Kafka answers NONE when the
    stored epoch is exactly one below the current one (`retryOnEpochBump`), or, after an epoch
    overflow rotated the producer id, when the request names the previous producer id at epoch
    32766 (`retryOnOverflow`). Nothing else has to be recorded to resume under either version,
    but all EndTxn requests for one transaction must use the same version family (a v4 retry of a
    v5 commit would be PRODUCER_FENCED because the epoch moved), which is why the version is a
    constructor setting and not negotiated per request. librdkafka (confluent-kafka 2.x) does not
    implement KIP-890 part 2, so the producers' own transactions are TV1-style; TV1 is the default.

Client library: kafka-python 3.0.12 (pinned). Requests go through its `KafkaConnectionManager`
on a `NetworkSelector` IO thread, the same layer its `KafkaAdminClient` uses; they are modules of
kafka-python's networking package rather than its documented top-level API, so an upgrade of
kafka-python must re-run tests/test_kafka_wire.py.

What is verified where: see tests/test_kafka_wire.py (Tansu stand-in broker, plus a fault
injecting proxy that substitutes real Kafka error codes where Tansu cannot produce them). The
Kafka-specific behaviour above (CONCURRENT_TRANSACTIONS while aborting, TV2 retries, error codes
for refused EndTxn) needs the real-Kafka e2e suite.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import kafka.errors as Errors
from kafka.net.manager import KafkaConnectionManager
from kafka.net.selector import NetworkSelector
from kafka.protocol.metadata import CoordinatorType, FindCoordinatorRequest
from kafka.protocol.producer import EndTxnRequest, InitProducerIdRequest

from .kafka_control import ControlPlaneError, KafkaTarget, PreparedTransaction

log = logging.getLogger(__name__)
T = TypeVar("T")

_NONE = Errors.NoError.errno
# answered by the broker when the request reached the wrong (or a not yet ready) coordinator:
# forget the cached coordinator and look it up again
_REFIND = {Errors.NotCoordinatorError.errno, Errors.CoordinatorNotAvailableError.errno}
_REFIND_NAMES = {"not_coordinator", "coordinator_not_available"}
# transient answers worth repeating as they are
_RETRY = {
    Errors.CoordinatorLoadInProgressError.errno,
    Errors.ConcurrentTransactionsError.errno,
    Errors.RequestTimedOutError.errno,
    Errors.NetworkExceptionError.errno,
    Errors.ThrottlingQuotaExceededError.errno,
}
# settings of the kafka-python connection layer a caller may pass (security, sockets, backoff)
_OWN_KEYS = {"bootstrap_servers", "metrics", "metric_group_prefix", "request_timeout_ms"}
_CLIENT_KEYS = (set(KafkaConnectionManager.DEFAULT_CONFIG) | set(NetworkSelector.DEFAULT_CONFIG)) - _OWN_KEYS


class _Retry(Exception):
    """One attempt failed in a way worth retrying."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


def _error_name(errno: int) -> str:
    if errno == Errors.UnknownError.errno:
        return "unknown_server_error"  # Kafka's name; kafka-python calls it UNKNOWN
    cls = Errors.for_code(errno)
    message = getattr(cls, "message", None)
    if message and message != "UNKNOWN":
        return str(message).lower()
    return f"kafka_error_{errno}"


def _is_retriable_code(errno: int) -> bool:
    if errno in _REFIND or errno in _RETRY:
        return True
    if errno in Errors.kafka_errors:
        return bool(Errors.kafka_errors[errno].retriable)
    return False  # unknown to kafka-python: not known to be transient


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
        self.closed = False

    def ensure_bootstrapped(self, timeout_ms: int) -> None:
        if self._manager.bootstrapped:
            return
        with self._bootstrap_lock:
            if self._manager.bootstrapped:
                return
            try:
                self._manager.bootstrap(timeout_ms)
            except Errors.KafkaError as exc:
                raise _Retry("broker_unreachable", f"cannot bootstrap from {self.bootstrap_servers}: {exc}") from exc

    def run(self, coro: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._manager.run(coro, *args)

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

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._manager.close()
        finally:
            self._net.stop(timeout_ms=5_000)


def _check(error_code: int, what: str) -> None:
    """Raise _Retry for transient broker answers, ControlPlaneError for refusals."""
    if error_code == _NONE:
        return
    name = _error_name(error_code)
    if _is_retriable_code(error_code):
        raise _Retry(name, f"{what}: broker answered {name.upper()} ({error_code})")
    raise ControlPlaneError(f"{what}: broker answered {name.upper()} ({error_code})", retriable=False, code=name)


class KafkaWireControlPlane:
    """`KafkaControlPlane` on Kafka's wire protocol. One instance serves every sink: connections
    are kept per bootstrap string and shared by all threads (commits of one checkpoint run in
    parallel).

    `request_timeout_ms` bounds each request; `retry_budget_ms` bounds the whole call including
    backoff (the call may overrun it by at most one request timeout). `client_config` is passed to
    kafka-python's connection layer: security (`security_protocol`, `sasl_mechanism`,
    `sasl_plain_username`, `sasl_plain_password`, `ssl_cafile`, `ssl_context`, ...), socket and
    reconnect settings. Pass secrets at run time; nothing here stores them beyond the client.
    """

    name = "kafka"

    def __init__(
        self,
        *,
        request_timeout_ms: int = 10_000,
        retry_budget_ms: int = 30_000,
        retry_backoff_ms: int = 100,
        retry_backoff_max_ms: int = 2_000,
        end_txn_max_version: int = 4,
        client_config: Mapping[str, Any] | None = None,
        client_id: str = "spark-eos-coordinator",
    ) -> None:
        if request_timeout_ms <= 0 or retry_budget_ms < 0 or retry_backoff_ms <= 0:
            raise ValueError("request_timeout_ms and retry_backoff_ms must be positive, retry_budget_ms >= 0")
        if not 0 <= end_txn_max_version <= EndTxnRequest.max_version:
            raise ValueError(f"end_txn_max_version must be within 0..{EndTxnRequest.max_version}")
        extra = set(client_config or {}) - _CLIENT_KEYS
        if extra:
            raise ValueError(f"unknown or reserved kafka client settings: {sorted(extra)}")
        self.request_timeout_ms = request_timeout_ms
        self.retry_budget_ms = retry_budget_ms
        self.retry_backoff_ms = retry_backoff_ms
        self.retry_backoff_max_ms = max(retry_backoff_max_ms, retry_backoff_ms)
        self.end_txn_max_version = end_txn_max_version
        self._config: dict[str, Any] = {
            "client_id": client_id,
            "reconnect_backoff_max_ms": 1_000,
            "socket_connection_setup_timeout_ms": min(10_000, request_timeout_ms),
            "socket_connection_setup_timeout_max_ms": max(10_000, request_timeout_ms),
            **(client_config or {}),
            "request_timeout_ms": request_timeout_ms,
        }
        self._clients: dict[str, _BrokerClient] = {}
        self._lock = threading.Lock()
        self._closed = False

    # --- the interface -------------------------------------------------------------------------

    def commit(self, target: KafkaTarget, txn: PreparedTransaction) -> None:
        if txn.producer_id < 0 or txn.producer_epoch < 0:
            raise ControlPlaneError(
                f"cannot resume {txn.transactional_id!r}: producer id {txn.producer_id} / epoch "
                f"{txn.producer_epoch} were never assigned",
                retriable=False,
                code="invalid_producer_id",
            )

        def attempt(client: _BrokerClient, timeout_ms: int) -> None:
            response = client.run(client.end_txn, txn, True, self.end_txn_max_version, timeout_ms)
            _check(response.error_code, f"EndTxn(commit {txn.transactional_id!r} pid={txn.producer_id} epoch={txn.producer_epoch})")
            if getattr(response, "producer_epoch", -1) not in (-1, None) and response.version >= 5:
                # TV2: the commit bumped the epoch; nothing of ours uses the new one, log it only
                log.info("committed %s; broker moved it to pid=%s epoch=%s", txn.transactional_id,
                         response.producer_id, response.producer_epoch)

        self._call(target, txn.transactional_id, "commit", attempt)

    def abort(self, target: KafkaTarget, transactional_id: str) -> None:
        def attempt(client: _BrokerClient, timeout_ms: int) -> None:
            response = client.run(client.init_producer_id, transactional_id, target.transaction_timeout_ms, timeout_ms)
            _check(response.error_code, f"InitProducerId({transactional_id!r})")
            log.info("aborted (fenced) %s: broker moved it to pid=%s epoch=%s",
                     transactional_id, response.producer_id, response.producer_epoch)

        self._call(target, transactional_id, "abort", attempt)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                client.close()
            except Exception:  # closing is best effort
                log.exception("closing the Kafka connection to %s failed", client.bootstrap_servers)

    # --- machinery ----------------------------------------------------------------------------

    def _client(self, bootstrap_servers: str) -> _BrokerClient:
        key = ",".join(s.strip() for s in bootstrap_servers.split(",") if s.strip())
        with self._lock:
            if self._closed:
                raise ControlPlaneError("the Kafka control plane is closed", retriable=True, code="closed")
            client = self._clients.get(key)
            if client is None or client.closed:
                client = self._clients[key] = _BrokerClient(key, self._config)
            return client

    def _discard(self, client: _BrokerClient) -> None:
        with self._lock:
            if self._clients.get(client.bootstrap_servers) is client:
                del self._clients[client.bootstrap_servers]
        client.close()

    def _call(
        self, target: KafkaTarget, transactional_id: str, what: str, attempt: Callable[[_BrokerClient, int], None]
    ) -> None:
        started = time.monotonic()
        deadline = started + self.retry_budget_ms / 1000
        tries = 0
        while True:
            tries += 1
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            timeout_ms = max(100, min(self.request_timeout_ms, remaining_ms))
            client: _BrokerClient | None = None
            try:
                client = self._client(target.bootstrap_servers)
                client.ensure_bootstrapped(timeout_ms)
                attempt(client, timeout_ms)
                if tries > 1:
                    log.info("%s of %s succeeded after %d tries", what, transactional_id, tries)
                return
            except ControlPlaneError:
                raise
            except _Retry as exc:
                code, detail = exc.code, str(exc)
                if code in _REFIND_NAMES and client is not None:
                    client.forget_coordinator(transactional_id)
            except Errors.KafkaError as exc:
                if isinstance(exc, Errors.BrokerResponseError) and not exc.retriable:
                    # e.g. an authorization or SASL failure surfaced by the connection layer
                    name = exc.message.lower() if exc.message else type(exc).__name__
                    raise ControlPlaneError(f"{what} of {transactional_id!r}: {exc}", retriable=False, code=name) from exc
                code = "request_timed_out" if isinstance(exc, (Errors.KafkaTimeoutError, Errors.RequestTimedOutError)) \
                    else "network_exception"
                detail = f"{what} of {transactional_id!r}: {type(exc).__name__}: {exc}"
                if client is not None:  # the coordinator may have moved or died
                    client.forget_coordinator(transactional_id)
            except (OSError, RuntimeError) as exc:  # socket trouble, or the IO loop died: start afresh
                code, detail = "network_exception", f"{what} of {transactional_id!r}: {type(exc).__name__}: {exc}"
                if client is not None:
                    self._discard(client)
            backoff = min(self.retry_backoff_max_ms, self.retry_backoff_ms * 2 ** (tries - 1)) / 1000
            backoff *= random.uniform(0.8, 1.2)
            if time.monotonic() + backoff >= deadline:
                elapsed = time.monotonic() - started
                raise ControlPlaneError(
                    f"{what} of {transactional_id!r} on {target.bootstrap_servers} did not succeed within "
                    f"{elapsed:.1f} s ({tries} tries); last: {detail}",
                    retriable=True,
                    code=code,
                )
            log.warning("%s of %s: retrying in %.2f s after %s", what, transactional_id, backoff, detail)
            time.sleep(backoff)
