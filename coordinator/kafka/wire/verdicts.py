"""The broker-check verdicts of `check_broker` and `coordinator doctor`: pure functions from
what the broker answered to a `BrokerCheck` with a plain-word message and its fix (unit tested,
tests/kafka/test_broker.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kafka.protocol.producer import (
    AddPartitionsToTxnRequest,
    EndTxnRequest,
    InitProducerIdRequest,
)

from ..control_plane import BrokerCheck
from .requests import KAFKA_DEFAULT_TRANSACTION_MAX_TIMEOUT_MS, TRANSACTION_MAX_TIMEOUT, UnsupportedByBroker

_TRANSACTION_APIS = (InitProducerIdRequest, AddPartitionsToTxnRequest, EndTxnRequest)


def verdict_transactions_supported(api_versions: Mapping[int, tuple[int, int]] | None) -> BrokerCheck:
    if api_versions is None:
        return BrokerCheck("transactions_supported", False, "the broker's ApiVersions answer is unknown: transaction "
                           "support could not be checked", fix="check that the bootstrap server is a Kafka broker")
    missing = [cls.__name__.removesuffix("Request") for cls in _TRANSACTION_APIS if cls.API_KEY not in api_versions]
    if missing:
        return BrokerCheck(
            "transactions_supported", False,
            f"the broker does not support transactions: its ApiVersions lacks {', '.join(missing)}",
            fix="use a Kafka broker with transactions (Apache Kafka >= 0.11, with the transaction state topic "
                "able to reach transaction.state.log.min.isr replicas)",
        )
    end_txn = api_versions[EndTxnRequest.API_KEY]
    return BrokerCheck("transactions_supported", True,
                       f"transactions supported: InitProducerId, AddPartitionsToTxn and EndTxn (v{end_txn[0]}-v{end_txn[1]}) are offered")


def verdict_transaction_timeout(broker_max_ms: int | None, sink_timeout_ms: int) -> BrokerCheck:
    name = "transaction_timeout"
    if broker_max_ms is None:
        fits = sink_timeout_ms <= KAFKA_DEFAULT_TRANSACTION_MAX_TIMEOUT_MS
        return BrokerCheck(
            name, fits,
            f"the broker did not report {TRANSACTION_MAX_TIMEOUT}; the sink's transaction.timeout.ms "
            f"{sink_timeout_ms} is {'within' if fits else 'above'} Kafka's default of "
            f"{KAFKA_DEFAULT_TRANSACTION_MAX_TIMEOUT_MS} (not verified against this broker)",
            fix=None if fits else f"raise {TRANSACTION_MAX_TIMEOUT} on every broker to at least {sink_timeout_ms}, "
                                  f"or lower the sink's transaction_timeout_ms",
        )
    if sink_timeout_ms > broker_max_ms:
        return BrokerCheck(
            name, False,
            f"the sink's transaction.timeout.ms {sink_timeout_ms} exceeds the broker's {TRANSACTION_MAX_TIMEOUT} "
            f"{broker_max_ms}: every producer's init_transactions would be refused (INVALID_TRANSACTION_TIMEOUT)",
            fix=f"raise {TRANSACTION_MAX_TIMEOUT} on every broker to at least {sink_timeout_ms}, or lower the "
                f"sink's transaction_timeout_ms to at most {broker_max_ms}",
        )
    return BrokerCheck(name, True, f"the sink's transaction.timeout.ms {sink_timeout_ms} is within the broker's "
                                   f"{TRANSACTION_MAX_TIMEOUT} {broker_max_ms}")


def verdict_prefix(listed: Iterable[tuple[str, int, str]], prefix: str, known_ids: set[str], *, incomplete: str = "") -> BrokerCheck:
    strangers = sorted({(tid, pid, state) for tid, pid, state in listed if tid.startswith(prefix) and tid not in known_ids})
    if strangers:
        shown = ", ".join(f"{tid} (producer id {pid}, {state})" for tid, pid, state in strangers[:10])
        more = f" and {len(strangers) - 10} more" if len(strangers) > 10 else ""
        return BrokerCheck(
            "prefix_unused", False,
            f"prefix {prefix!r} already in use by producers the coordinator does not know: {shown}{more}",
            fix="give this sink a transactional_id_prefix no other application uses, or stop the producers using "
                "these ids: the coordinator would abort their transactions and they would fence its leases",
        )
    return BrokerCheck("prefix_unused", True,
                       f"no transactional id under prefix {prefix!r} on the broker other than the sink's own "
                       f"(ListTransactions lists only ids the principal may Describe){incomplete}")


def verdict_unsupported(name: str, exc: UnsupportedByBroker, fix: str) -> BrokerCheck:
    return BrokerCheck(name, False, str(exc), fix=fix, verified=False)
