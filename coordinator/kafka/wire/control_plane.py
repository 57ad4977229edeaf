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

commit_all, abort_all
    A whole pass (passes.py): the requests, retries and verdicts of commit and abort for each of a
    batch's transactions, in rounds run by one coroutine on the connection's IO thread. A single
    commit or abort (`commit`, `abort`) is a pass of one.

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
    Only the codes in rules.TRANSACTION_GONE_CODES end a decided commit; after any other refusal
    the commit stays decided and is retried by the recovery loop with backoff.

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

Observations (the lingering-transaction sweep, stuck consumers, broker checks)
    list_open_transactions: ListTransactions (state filters Ongoing, PrepareCommit, PrepareAbort,
    PrepareEpochFence; from v2 also a \\Q<prefix>\\E.* pattern) sent to EVERY broker, since each is
    the transaction coordinator of a slice of the ids; the prefix is filtered client-side; then
    DescribeTransactions on the broker that listed them for producer id, epoch, state, start time,
    timeout and partitions (ids that completed in between are dropped).
    partition_stability: Metadata for partitions and leaders; per leader ListOffsets(LATEST) at
    READ_UNCOMMITTED (high watermark) and READ_COMMITTED (last stable offset); for partitions
    whose LSO is below the HW, DescribeProducers on the leader names the producer whose open
    transaction started first (lowest currentTxnStartOffset: it holds the LSO). Best effort: a
    broker without DescribeProducers still gives offsets.
    check_broker: a fresh connection; bootstrap reachable; every broker's advertised address
    reachable; ApiVersions offers InitProducerId, AddPartitionsToTxn, EndTxn; DescribeConfigs of
    the broker's transaction.max.timeout.ms (Kafka default 900000) not below the sink's timeout;
    ListTransactions (all states) shows no id under the prefix the coordinator does not know.
    Plain-word verdicts with their fix; authorization errors (CLUSTER_, TRANSACTIONAL_ID_,
    TOPIC_AUTHORIZATION_FAILED) are named as such with the ACL the principal lacks.
    A broker without an API (not in its ApiVersions) is refused up front with
    `UnsupportedByBroker` ("broker does not support ListTransactions (KIP-664, Kafka >= 3.0):
    lingering-transaction sweep unavailable"), never retried.

Client library: kafka-python 3.0.12 (pinned). Requests go through its `KafkaConnectionManager`
on a `NetworkSelector` IO thread, the same layer its `KafkaAdminClient` uses; they are modules of
kafka-python's networking package rather than its documented top-level API, so an upgrade of
kafka-python must re-run tests/kafka/test_kafka_wire.py.

What is verified where: tests/kafka/test_kafka_wire.py and tests/kafka/test_broker_wire.py, against a real
Apache Kafka formatted with transaction.version 1 and 2 (localkafka/), with a fault proxy in front
of it for lost answers, delays and transient error codes.

Where the parts are: this module is the control plane (the calls above, their retries and
verdicts); connection.py the connection manager per bootstrap string and the requests it sends;
errors.py which error codes are retried; requests.py the observation requests and the parsing of
their answers; verdicts.py the broker-check verdicts; passes.py a pass.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import kafka.errors as Errors
from kafka.protocol.admin.configs import DescribeConfigsRequest
from kafka.protocol.admin.transactions import ListTransactionsRequest
from kafka.protocol.producer import EndTxnRequest

from ..control_plane import (
    BrokerCheck,
    CallOutcome,
    ControlPlaneError,
    FirstOffset,
    raise_for,
    KafkaTarget,
    OpenTransaction,
    PartitionStability,
    PreparedTransaction,
    TransactionOutcome,
)
from . import passes
from .connection import _CLIENT_KEYS, DEFAULT_MAX_IN_FLIGHT, _BrokerClient
from .errors import DISCARD, REFIND, _check, _Retry, classify_failure
from .requests import (
    KAFKA_DEFAULT_TRANSACTION_MAX_TIMEOUT_MS,
    TRANSACTION_MAX_TIMEOUT,
    UnsupportedByBroker,
    authorization_message,
    is_authorization_error,
)
from .verdicts import verdict_prefix, verdict_transaction_timeout, verdict_transactions_supported, verdict_unsupported

log = logging.getLogger(__name__)
T = TypeVar("T")


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
            # parallel commits of one checkpoint pipeline on the coordinator's connection
            "max_in_flight_requests_per_connection": DEFAULT_MAX_IN_FLIGHT,
            **(client_config or {}),
            "request_timeout_ms": request_timeout_ms,
        }
        self._clients: dict[str, _BrokerClient] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()  # wakes retry back-offs at close: shutdown takes seconds

    # --- the interface -------------------------------------------------------------------------

    def commit(self, target: KafkaTarget, txn: PreparedTransaction) -> None:
        """One transaction's commit: a pass of one."""
        raise_for(self.commit_all(target, [txn], 1)[0])

    def abort(self, target: KafkaTarget, transactional_id: str) -> None:
        """One id's abort: a pass of one."""
        raise_for(self.abort_all(target, [transactional_id], 1)[0])

    @staticmethod
    def _resumable(txn: PreparedTransaction) -> None:
        if txn.producer_id < 0 or txn.producer_epoch < 0:
            raise ControlPlaneError(
                f"cannot resume {txn.transactional_id!r}: producer id {txn.producer_id} / epoch "
                f"{txn.producer_epoch} were never assigned",
                retriable=False,
                code="invalid_producer_id",
            )

    @staticmethod
    def _committed(response: Any, txn: PreparedTransaction) -> None:
        """EndTxn(commit)'s answer checked (_check raises for anything but NONE)."""
        _check(response.error_code, f"EndTxn(commit {txn.transactional_id!r} pid={txn.producer_id} epoch={txn.producer_epoch})")
        if getattr(response, "producer_epoch", -1) not in (-1, None) and response.version >= 5:
            # TV2: the commit bumped the epoch; nothing of ours uses the new one, log it only
            log.info("committed %s; broker moved it to pid=%s epoch=%s", txn.transactional_id,
                     response.producer_id, response.producer_epoch)

    @staticmethod
    def _fenced(response: Any, transactional_id: str) -> None:
        """InitProducerId's answer checked: NONE once no transaction of the id is open any more."""
        _check(response.error_code, f"InitProducerId({transactional_id!r})")
        log.info("aborted (fenced) %s: broker moved it to pid=%s epoch=%s",
                 transactional_id, response.producer_id, response.producer_epoch)

    def commit_all(self, target: KafkaTarget, txns: Sequence[PreparedTransaction], parallelism: int,
                   budget_ms: int | None = None) -> list[CallOutcome]:
        """EndTxn(commit) of each transaction, as one pass (passes.py); each one's outcome in order."""
        outcomes: list[CallOutcome | None] = [None] * len(txns)
        valid = []
        for i, txn in enumerate(txns):
            try:
                self._resumable(txn)
                valid.append(i)
            except ControlPlaneError as exc:
                outcomes[i] = CallOutcome(exc)

        async def attempt(client: _BrokerClient, k: int, timeout_ms: int) -> None:
            self._committed(await client.end_txn(txns[valid[k]], True, self.end_txn_max_version, timeout_ms), txns[valid[k]])

        done = passes.run_pass(self, target, [txns[i].transactional_id for i in valid], "commit", attempt, parallelism,
                               budget_ms)
        for i, outcome in zip(valid, done):
            outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    def abort_all(self, target: KafkaTarget, transactional_ids: Sequence[str], parallelism: int,
                  budget_ms: int | None = None) -> list[CallOutcome]:
        """InitProducerId on each id, as one pass (passes.py); each one's outcome in order."""

        async def attempt(client: _BrokerClient, k: int, timeout_ms: int) -> None:
            tid = transactional_ids[k]
            self._fenced(await client.init_producer_id(tid, target.transaction_timeout_ms, timeout_ms), tid)

        return passes.run_pass(self, target, list(transactional_ids), "abort", attempt, parallelism, budget_ms)

    def transaction_outcome(
        self, target: KafkaTarget, txn: PreparedTransaction, first_offsets: Sequence[FirstOffset]
    ) -> TransactionOutcome:
        from ..outcome import read_committed_outcome

        return read_committed_outcome(target.bootstrap_servers, first_offsets, self._config, self.request_timeout_ms)

    # --- observations (KIP-664 sweep, stuck consumers, broker checks) --------------------------

    def list_open_transactions(self, target: KafkaTarget, prefix: str) -> list[OpenTransaction]:
        """Raises `UnsupportedByBroker` (a non-retriable ControlPlaneError, code
        "unsupported_by_broker") when the broker lacks ListTransactions / DescribeTransactions."""

        def attempt(client: _BrokerClient, timeout_ms: int) -> list[OpenTransaction]:
            return client.run(client.open_transactions, prefix, timeout_ms)

        return self._call(target, prefix, "list open transactions", attempt)

    def partition_stability(self, target: KafkaTarget, topics: list[str]) -> list[PartitionStability]:
        """A broker without DescribeProducers still answers; the blocking producer is then None."""
        if not topics:
            return []

        def attempt(client: _BrokerClient, timeout_ms: int) -> list[PartitionStability]:
            return client.run(client.stability, list(topics), timeout_ms)

        return self._call(target, ",".join(topics), "partition stability", attempt)

    def check_broker(self, target: KafkaTarget, prefix: str, known_ids: set[str]) -> list[BrokerCheck]:
        """Plain-word verdicts, each with its fix when it failed. Never raises for a broker
        problem: an unreachable or refusing broker is a verdict. Uses a fresh connection so the
        answer reflects the broker now, not a cached connection."""
        key = ",".join(s.strip() for s in target.bootstrap_servers.split(",") if s.strip())
        client = _BrokerClient(key, self._config)
        try:
            return self._check_broker(client, target, prefix, known_ids)
        finally:
            client.close()

    def _check_broker(self, client: _BrokerClient, target: KafkaTarget, prefix: str, known_ids: set[str]) -> list[BrokerCheck]:
        timeout_ms = self.request_timeout_ms
        servers = client.bootstrap_servers
        try:
            client.ensure_bootstrapped(timeout_ms)
        except _Retry as exc:
            cause = exc.__cause__ or exc
            return [BrokerCheck(
                "bootstrap", False,
                f"cannot reach any bootstrap server {servers} within {timeout_ms} ms ({cause}); the other checks "
                "need a reachable broker",
                fix="check kafka.bootstrap.servers (host:port of a listener the coordinator can reach) and the "
                    "network path (DNS, firewall, security groups); with TLS or SASL listeners also the "
                    "coordinator's Kafka client settings",
            )]
        brokers = client.brokers()
        checks = [BrokerCheck("bootstrap", True, f"bootstrap server {servers} answered: {len(brokers)} broker(s) in the cluster")]

        reachable, unreachable = [], []
        for broker in brokers:
            try:
                client.run(client.connect, broker.node_id, timeout_ms)
                reachable.append(broker)
            except Exception as exc:  # noqa: BLE001 - any failure to connect is the verdict
                unreachable.append((broker, exc))
        listeners_fix = (
            "set advertised.listeners on these brokers (for the listener the coordinator and the Spark executors "
            "use) to a host:port reachable from them -- not localhost, a container-internal name or a private "
            "address -- or bootstrap through a listener that advertises reachable addresses"
        )
        if unreachable:
            shown = "; ".join(f"node {b.node_id} at {b.host}:{b.port} ({type(e).__name__}: {e})" for b, e in unreachable)
            checks.append(BrokerCheck(
                "advertised_listeners", False,
                f"the bootstrap server answered, but brokers advertise addresses the coordinator cannot reach: {shown}. "
                "After bootstrap every Kafka client talks only to the advertised addresses, so producers and the "
                "coordinator cannot reach the partition leaders or the transaction coordinator: this is the classic "
                "\"Timed out waiting for a node assignment\" (Java clients) or init_transactions/flush timing out "
                "(librdkafka)",
                fix=listeners_fix,
            ))
        else:
            shown = ", ".join(f"node {b.node_id} at {b.host}:{b.port}" for b in brokers)
            checks.append(BrokerCheck("advertised_listeners", True, f"every broker's advertised address is reachable: {shown}"))

        checks.append(verdict_transactions_supported(client.api_versions))
        checks.append(self._timeout_check(client, target, reachable, timeout_ms, listeners_fix))
        checks.append(self._prefix_check(client, prefix, known_ids, reachable, len(unreachable), timeout_ms, listeners_fix))
        return checks

    @staticmethod
    def _timeout_check(client: _BrokerClient, target: KafkaTarget, reachable: list[Any], timeout_ms: int,
                       listeners_fix: str) -> BrokerCheck:
        name = "transaction_timeout"
        if not reachable:
            return BrokerCheck(name, False, f"could not read the broker's {TRANSACTION_MAX_TIMEOUT}: no broker is "
                                            "reachable at its advertised address", fix=listeners_fix)
        node_id = reachable[0].node_id
        try:
            broker_max = client.run(client.transaction_max_timeout, node_id, timeout_ms)
        except UnsupportedByBroker as exc:
            fits = target.transaction_timeout_ms <= KAFKA_DEFAULT_TRANSACTION_MAX_TIMEOUT_MS
            return BrokerCheck(name, fits, f"{exc}; the sink's transaction.timeout.ms {target.transaction_timeout_ms} "
                                           f"is {'within' if fits else 'above'} Kafka's default of "
                                           f"{KAFKA_DEFAULT_TRANSACTION_MAX_TIMEOUT_MS} (not verified)",
                               fix=None if fits else "check the brokers' transaction.max.timeout.ms by hand")
        except ControlPlaneError as exc:
            if is_authorization_error(exc.code):
                return BrokerCheck(name, False, authorization_message(DescribeConfigsRequest.API_KEY, exc.code),
                                   fix="grant the coordinator's principal DescribeConfigs on the cluster, or check "
                                       f"{TRANSACTION_MAX_TIMEOUT} on the brokers by hand")
            return BrokerCheck(name, False, f"could not read the broker's {TRANSACTION_MAX_TIMEOUT}: {exc}",
                               fix="retry the check; if it persists, check the broker's logs")
        except (_Retry, Errors.KafkaError, OSError, RuntimeError) as exc:
            return BrokerCheck(name, False, f"could not read the broker's {TRANSACTION_MAX_TIMEOUT} from node "
                                            f"{node_id}: {type(exc).__name__}: {exc}",
                               fix="retry the check; if it persists, check the broker's logs")
        return verdict_transaction_timeout(broker_max, target.transaction_timeout_ms)

    @staticmethod
    def _prefix_check(client: _BrokerClient, prefix: str, known_ids: set[str], reachable: list[Any], n_unreachable: int,
                      timeout_ms: int, listeners_fix: str) -> BrokerCheck:
        name = "prefix_unused"
        if not reachable:
            return BrokerCheck(name, False, "could not list the broker's transactional ids: no broker is reachable at "
                                            "its advertised address", fix=listeners_fix)
        listed: list[tuple[str, int, str]] = []
        try:
            for broker in reachable:  # every broker coordinates some ids; all states, not only open ones
                listed.extend(client.run(client.list_transactions, broker.node_id, (), prefix, timeout_ms))
        except UnsupportedByBroker as exc:
            return verdict_unsupported(
                name, exc,
                "use Apache Kafka >= 3.0 to let the coordinator see other producers under the prefix and sweep "
                "lingering transactions; meanwhile make sure no other application uses this prefix (the coordinator "
                "still aborts every id its database knows)",
            )
        except ControlPlaneError as exc:
            if is_authorization_error(exc.code):
                return BrokerCheck(name, False, authorization_message(ListTransactionsRequest.API_KEY, exc.code, prefix),
                                   fix=f"grant the coordinator's principal Describe on transactional ids with prefix "
                                       f"{prefix!r} (a PREFIXED TransactionalId ACL) and Describe on the cluster")
            return BrokerCheck(name, False, f"could not list the broker's transactional ids: {exc}",
                               fix="retry the check; if it persists, check the broker's logs")
        except (_Retry, Errors.KafkaError, OSError, RuntimeError) as exc:
            return BrokerCheck(name, False, f"could not list the broker's transactional ids: {type(exc).__name__}: {exc}",
                               fix="retry the check; if it persists, check the broker's logs")
        incomplete = f"; {n_unreachable} unreachable broker(s) not listed" if n_unreachable else ""
        return verdict_prefix(listed, prefix, known_ids, incomplete=incomplete)

    def close(self) -> None:
        self._closing.set()
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

    def _before_next_try(self, client: _BrokerClient | None, action: str | None, keys: Sequence[str]) -> None:
        if client is None:
            return
        if action == REFIND:
            for key in keys:
                client.forget_coordinator(key)
        elif action == DISCARD:
            self._discard(client)

    def _backoff(self, tries: int) -> float:
        """Seconds to wait after the tries-th failed try: exponential, with jitter."""
        backoff = min(self.retry_backoff_max_ms, self.retry_backoff_ms * 2 ** (tries - 1)) / 1000
        return backoff * random.uniform(0.8, 1.2)

    def _discard(self, client: _BrokerClient) -> None:
        with self._lock:
            if self._clients.get(client.bootstrap_servers) is client:
                del self._clients[client.bootstrap_servers]
        client.close()

    def _call(
        self, target: KafkaTarget, transactional_id: str, what: str, attempt: Callable[[_BrokerClient, int], T]
    ) -> T:
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
                if not client.slots.acquire(timeout=timeout_ms / 1000):
                    raise _Retry("request_timed_out", f"{what} of {transactional_id!r}: no request slot on the "
                                                      f"connection within {timeout_ms} ms")
                try:
                    result = attempt(client, timeout_ms)
                finally:
                    client.slots.release()
                if tries > 1:
                    log.info("%s of %s succeeded after %d tries", what, transactional_id, tries)
                return result
            except Exception as exc:  # noqa: BLE001 - classify_failure raises what ends the call
                code, detail, action = classify_failure(exc, what, transactional_id)
                self._before_next_try(client, action, [transactional_id])
            backoff = self._backoff(tries)
            if time.monotonic() + backoff >= deadline:
                elapsed = time.monotonic() - started
                raise ControlPlaneError(
                    f"{what} of {transactional_id!r} on {target.bootstrap_servers} did not succeed within "
                    f"{elapsed:.1f} s ({tries} tries); last: {detail}",
                    retriable=True,
                    code=code,
                )
            log.warning("%s of %s: retrying in %.2f s after %s", what, transactional_id, backoff, detail)
            if self._closing.wait(backoff):
                raise ControlPlaneError(f"{what} of {transactional_id!r}: the Kafka control plane is closed "
                                        f"(last: {detail})", retriable=True, code="closed")
