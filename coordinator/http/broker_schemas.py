"""Response bodies of REST API v1's broker observations (coordinator/kafka/broker.py): a sink's
broker checks and its partitions' last stable offsets, with what blocks them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class BrokerCheckOut(BaseModel):
    name: str
    ok: bool
    verdict: str = Field(description="what was found, in plain words")
    fix: str | None = Field(description="what to change when the check failed")
    verified: bool = Field(True, description="false when the broker cannot answer this question (e.g. lacks the API)")


class BlockingTransactionOut(BaseModel):
    producer_id: int | None
    producer_epoch: int | None
    transactional_id: str | None
    lease_id: int | None
    lease_state: str | None
    known: bool = Field(description="the coordinator's own transaction (one of its leases)")
    explanation: str


class PartitionOut(BaseModel):
    topic: str
    partition: int
    high_watermark: int
    last_stable_offset: int
    lag: int = Field(description="records read_committed consumers cannot read yet (high watermark - last stable offset)")
    stuck: bool = Field(description="the last stable offset stayed below the high watermark since the previous observation")
    stalled_for_s: float | None
    blocking_producer_id: int | None
    blocking_producer_epoch: int | None
    blocking_txn_start_offset: int | None
    blocking_transaction: BlockingTransactionOut | None


class PartitionsOut(BaseModel):
    partitions: list[PartitionOut]
    notes: list[str]

    @classmethod
    def of(cls, report: Any) -> PartitionsOut:
        stuck = {(s.topic, s.partition): s for s in report.stuck}
        blocking = {(b.topic, b.partition): b for b in report.blocking}
        rows = []
        for p in report.partitions:
            key = (p.topic, p.partition)
            b = blocking.get(key)
            rows.append(PartitionOut(
                topic=p.topic,
                partition=p.partition,
                high_watermark=p.high_watermark,
                last_stable_offset=p.last_stable_offset,
                lag=p.high_watermark - p.last_stable_offset,
                stuck=key in stuck,
                stalled_for_s=stuck[key].stalled_for_s if key in stuck else None,
                blocking_producer_id=p.blocking_producer_id,
                blocking_producer_epoch=p.blocking_producer_epoch,
                blocking_txn_start_offset=p.blocking_txn_start_offset,
                blocking_transaction=None if b is None else BlockingTransactionOut(
                    producer_id=b.producer_id, producer_epoch=b.producer_epoch, transactional_id=b.transactional_id,
                    lease_id=b.lease_id, lease_state=b.lease_state, known=b.known, explanation=b.explanation,
                ),
            ))
        return cls(partitions=rows, notes=list(report.notes))
