"""The observation requests of the wire control plane and the parsing of their answers
(KIP-664 transactions, offsets, configs), and what is lost when the broker lacks one of these APIs
or refuses it for want of an ACL: pure functions on kafka-python's protocol classes, unit tested
without a broker (tests/kafka/test_broker.py)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import kafka.errors as Errors
from kafka.protocol.admin.configs import DescribeConfigsRequest
from kafka.protocol.admin.transactions import (
    DescribeProducersRequest,
    DescribeTransactionsRequest,
    ListTransactionsRequest,
)
from kafka.protocol.consumer.offsets import (
    IsolationLevel,
    ListOffsetsRequest,
    OffsetSpec,
)
from kafka.protocol.metadata import MetadataRequest

from ..control_plane import (
    ControlPlaneError,
    OpenTransaction,
)
from .errors import _NONE, _check, _error_name, _Retry

# Kafka's TransactionState names (ListTransactions / DescribeTransactions wire values) of a
# transaction that is not completed: it may still hold the last stable offset of its partitions
OPEN_STATES = ("Ongoing", "PrepareCommit", "PrepareAbort", "PrepareEpochFence")
TRANSACTION_MAX_TIMEOUT = "transaction.max.timeout.ms"
KAFKA_DEFAULT_TRANSACTION_MAX_TIMEOUT_MS = 900_000
_BROKER_RESOURCE = 4  # DescribeConfigs resource type BROKER

# what each observation API is, and what is lost without it
_API_INFO: dict[int, tuple[str, str, str]] = {
    ListTransactionsRequest.API_KEY: ("ListTransactions", "KIP-664, Kafka >= 3.0", "lingering-transaction sweep unavailable"),
    DescribeTransactionsRequest.API_KEY: ("DescribeTransactions", "KIP-664, Kafka >= 3.0", "lingering-transaction sweep unavailable"),
    DescribeProducersRequest.API_KEY: ("DescribeProducers", "KIP-664, Kafka >= 3.0",
                                       "the producer holding a partition's last stable offset cannot be named"),
    DescribeConfigsRequest.API_KEY: ("DescribeConfigs", "KIP-133, Kafka >= 0.11",
                                     f"the broker's {TRANSACTION_MAX_TIMEOUT} cannot be read"),
}
# the ACL each API needs, for authorization verdicts in plain words
_ACL_NEEDED: dict[int, str] = {
    ListTransactionsRequest.API_KEY: "Describe on the transactional ids under the prefix",
    DescribeTransactionsRequest.API_KEY: "Describe on the transactional ids under the prefix",
    DescribeProducersRequest.API_KEY: "Read on the sink's topics",
    DescribeConfigsRequest.API_KEY: "DescribeConfigs on the cluster",
    MetadataRequest.API_KEY: "Describe on the sink's topics",
    ListOffsetsRequest.API_KEY: "Describe on the sink's topics",
}


class UnsupportedByBroker(ControlPlaneError):
    """The broker does not implement an API an observation needs (it is not in its ApiVersions)."""

    def __init__(self, api_key: int) -> None:
        name, kip, lost = _API_INFO.get(api_key, (f"api {api_key}", "", "this observation is unavailable"))
        since = f" ({kip})" if kip else ""
        super().__init__(f"broker does not support {name}{since}: {lost}", retriable=False, code="unsupported_by_broker")
        self.api_key = api_key
        self.api_name = name


def is_authorization_error(errno_or_code: int | str) -> bool:
    if isinstance(errno_or_code, str):
        return errno_or_code.endswith("_authorization_failed")
    return issubclass(Errors.for_code(errno_or_code), Errors.AuthorizationError)


def authorization_message(api_key: int, code: str, prefix: str | None = None) -> str:
    name = _API_INFO.get(api_key, (None,))[0] or {MetadataRequest.API_KEY: "Metadata",
                                                  ListOffsetsRequest.API_KEY: "ListOffsets"}.get(api_key, f"api {api_key}")
    needed = _ACL_NEEDED.get(api_key, "the ACL this request needs")
    if code == "cluster_authorization_failed":
        needed = f"{'DescribeConfigs' if api_key == DescribeConfigsRequest.API_KEY else 'Describe'} on the cluster"
    elif code == "transactional_id_authorization_failed":
        needed = "Describe on the transactional ids under the prefix"
    elif code == "topic_authorization_failed":
        needed = "Describe/Read on the sink's topics"
    if prefix is not None:
        needed = needed.replace("the prefix", f"prefix {prefix!r}")
    return f"not authorized: the broker refused {name} with {code.upper()}: the coordinator's principal lacks {needed}"


def list_transactions_request(state_filters: Iterable[str], prefix: str | None, version: int) -> ListTransactionsRequest:
    """ListTransactions; from v2 (Kafka 4.1, KIP-1152) the broker filters by a regex on the id too
    (Java's \\Q...\\E quoting); the prefix is filtered client-side anyway."""
    kwargs: dict[str, Any] = {"state_filters": list(state_filters), "producer_id_filters": []}
    if prefix and version >= 2 and "\\E" not in prefix:
        kwargs["transactional_id_pattern"] = "\\Q" + prefix + "\\E.*"
        kwargs["min_version"] = 2
    return ListTransactionsRequest(**kwargs)


def parse_list_transactions(response: Any, prefix: str) -> list[tuple[str, int, str]]:
    """(transactional id, producer id, state) of every listed transaction under prefix."""
    _check(response.error_code, "ListTransactions")
    return sorted(
        (t.transactional_id, t.producer_id, t.transaction_state)
        for t in response.transaction_states
        if t.transactional_id.startswith(prefix)
    )


def parse_describe_transactions(response: Any) -> list[OpenTransaction]:
    """The described transactions that are not completed. An id the coordinator no longer knows
    (TRANSACTIONAL_ID_NOT_FOUND: it completed and expired since it was listed) is skipped."""
    found = []
    for t in response.transaction_states:
        if t.error_code == Errors.TransactionalIdNotFoundError.errno:
            continue
        _check(t.error_code, f"DescribeTransactions({t.transactional_id!r})")
        if t.transaction_state not in OPEN_STATES:
            continue
        found.append(OpenTransaction(
            transactional_id=t.transactional_id,
            producer_id=t.producer_id,
            producer_epoch=t.producer_epoch,
            state=t.transaction_state,
            started_at_ms=t.transaction_start_time_ms if t.transaction_start_time_ms >= 0 else None,
            timeout_ms=t.transaction_timeout_ms if t.transaction_timeout_ms >= 0 else None,
            partitions=tuple(sorted((topic.topic, p) for topic in t.topics for p in topic.partitions)),
        ))
    return found


def parse_metadata(response: Any, topics: Iterable[str]) -> dict[str, list[tuple[int, int]]]:
    """topic -> [(partition, leader node id)], for the asked topics."""
    wanted = set(topics)
    layout: dict[str, list[tuple[int, int]]] = {}
    for t in response.topics:
        if t.name not in wanted:
            continue
        if t.error_code == Errors.UnknownTopicOrPartitionError.errno:
            raise ControlPlaneError(f"topic {t.name!r} does not exist on the broker", retriable=True,
                                    code="unknown_topic_or_partition")
        _check(t.error_code, f"Metadata({t.name!r})")
        partitions = []
        for p in t.partitions:
            if p.leader_id < 0:
                raise _Retry("leader_not_available", f"Metadata: {t.name}-{p.partition_index} has no leader")
            partitions.append((p.partition_index, p.leader_id))
        layout[t.name] = sorted(partitions)
    missing = wanted - set(layout)
    if missing:
        raise _Retry("unknown_topic_or_partition", f"Metadata answered no row for {sorted(missing)}")
    return layout


def list_offsets_request(partitions: Iterable[tuple[str, int]], isolation: IsolationLevel) -> ListOffsetsRequest:
    by_topic: dict[str, list[int]] = defaultdict(list)
    for topic, partition in partitions:
        by_topic[topic].append(partition)
    topic_cls = ListOffsetsRequest.ListOffsetsTopic
    part_cls = topic_cls.ListOffsetsPartition
    return ListOffsetsRequest(
        replica_id=-1,
        isolation_level=int(isolation),
        topics=[topic_cls(name=t, partitions=[part_cls(partition_index=p, timestamp=int(OffsetSpec.LATEST)) for p in ps])
                for t, ps in sorted(by_topic.items())],
        min_version=2,  # isolation_level exists from v2
    )


def parse_list_offsets(response: Any) -> dict[tuple[str, int], int]:
    """(topic, partition) -> offset. LATEST at READ_UNCOMMITTED is the high watermark, at
    READ_COMMITTED the last stable offset."""
    offsets = {}
    for topic in response.topics:
        for p in topic.partitions:
            _check(p.error_code, f"ListOffsets({topic.name}-{p.partition_index})")
            offsets[(topic.name, p.partition_index)] = p.offset
    return offsets


def describe_producers_request(partitions: Iterable[tuple[str, int]]) -> DescribeProducersRequest:
    by_topic: dict[str, list[int]] = defaultdict(list)
    for topic, partition in partitions:
        by_topic[topic].append(partition)
    topic_cls = DescribeProducersRequest.TopicRequest
    return DescribeProducersRequest(topics=[topic_cls(name=t, partition_indexes=sorted(ps)) for t, ps in sorted(by_topic.items())])


def parse_describe_producers(response: Any) -> tuple[dict[tuple[str, int], tuple[int, int, int]], dict[tuple[str, int], str]]:
    """(blocking, errors): per partition the producer whose open transaction started first
    (lowest currentTxnStartOffset: it is what holds the last stable offset) as (producer id,
    epoch, start offset); partitions the broker refused, with the error name."""
    blocking: dict[tuple[str, int], tuple[int, int, int]] = {}
    errors: dict[tuple[str, int], str] = {}
    for topic in response.topics:
        for p in topic.partitions:
            key = (topic.name, p.partition_index)
            if p.error_code != _NONE:
                errors[key] = _error_name(p.error_code)
                continue
            open_ones = [a for a in p.active_producers if a.current_txn_start_offset >= 0]
            if open_ones:
                first = min(open_ones, key=lambda a: (a.current_txn_start_offset, a.producer_id))
                blocking[key] = (first.producer_id, first.producer_epoch, first.current_txn_start_offset)
    return blocking, errors


def describe_broker_configs_request(node_id: int) -> DescribeConfigsRequest:
    # every config of the broker (configuration_keys null): brokers that cannot decode a key list exist
    resource = DescribeConfigsRequest.DescribeConfigsResource
    return DescribeConfigsRequest(
        resources=[resource(resource_type=_BROKER_RESOURCE, resource_name=str(node_id), configuration_keys=None)],
        include_synonyms=False, include_documentation=False,
    )


def parse_transaction_max_timeout(response: Any) -> int | None:
    """The broker's transaction.max.timeout.ms, or None if it did not report it."""
    for result in response.results:
        _check(result.error_code, f"DescribeConfigs(broker {result.resource_name})")
        for config in result.configs:
            if config.name == TRANSACTION_MAX_TIMEOUT and config.value not in (None, ""):
                return int(config.value)
    return None
