"""The e2e suite's checker (e2e/checker.py) and verifier (e2e/verify_output.py), tested here where
the compose stack cannot start: (a) hand-made topic dumps that must fail in each way and pass when
right, through the verifier's command line; (b) the simulation's model of Kafka (sim/): its
read_committed view after seeded fault schedules must pass, and the same output corrupted (an
aborted transaction's records delivered, a committed record dropped, a transaction left open)
must fail; (c) the verifier (read_committed consumer, KIP-664 listing, ListOffsets) against the
real broker, and a deliberately broken variant of it (read_uncommitted) that must fail."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.kafka_producers import run_transactional_producer
from fixtures.real_kafka import RealKafka
from sqlalchemy import Engine

from coordinator.kafka.control_plane import OpenTransaction
from e2e import verify_output
from e2e.checker import Record, check, expected_range, read_dump, write_dump
from sim.faults import FaultConfig
from sim.runner import Sim, run_and_keep


def rec(value: str | bytes | None, partition: int = 0, offset: int = 0, *, key: str | bytes | None = "same",
        batch: int = 0, attempt: int = 1, lease: int = 1) -> Record:
    v = value.encode() if isinstance(value, str) else value
    k = v if key == "same" else (key.encode() if isinstance(key, str) else key)
    headers = (("eos-sink", b"demo"), ("eos-batch-id", str(batch).encode()), ("eos-attempt", str(attempt).encode()),
               ("eos-lease-id", str(lease).encode()))
    return Record("exactly-once-demo", partition, offset, k, v, headers)


def good_output(n: int) -> list[Record]:
    return [rec(str(i), partition=i % 3, offset=i // 3, batch=i // 4) for i in range(n)]


def open_txn(tid: str) -> OpenTransaction:
    return OpenTransaction(tid, 7, 3, "Ongoing", None, None)


# --- (a) hand-made dumps -------------------------------------------------------------------------


def test_exactly_the_input_once_passes() -> None:
    v = check(good_output(10), expected_range(10), [], prefix="demo-", key_equals_value=True)
    assert v.ok, v.report()
    assert v.report().startswith("PASS: 10 records read_committed, 10 expected")


def test_a_missing_value_fails_and_is_named() -> None:
    out = [r for r in good_output(10) if r.value != b"7"]
    v = check(out, expected_range(10))
    assert not v.ok and v.missing == ["7"] and not v.duplicates and not v.unexpected
    assert "missing (1): 7" in v.report()


def test_a_duplicate_fails_and_says_where_each_copy_came_from() -> None:
    replayed = rec("4", partition=2, offset=99, batch=1, attempt=2, lease=17)
    v = check([*good_output(10), replayed], expected_range(10))
    assert not v.ok and not v.missing and list(v.duplicates) == ["4"]
    first, second = v.duplicates["4"]
    assert first == "exactly-once-demo[1]@1 eos-sink=demo eos-batch-id=1 eos-attempt=1 eos-lease-id=1"
    assert second == "exactly-once-demo[2]@99 eos-sink=demo eos-batch-id=1 eos-attempt=2 eos-lease-id=17"
    assert "'4' x2" in v.report()


def test_unexpected_undecodable_and_key_mismatched_records_fail() -> None:
    v = check([*good_output(3), rec("12"), rec(b"\xff\xfe", offset=5)], expected_range(3))
    assert not v.ok and list(v.unexpected) == ["b'\\xff\\xfe'", "12"]
    v = check([rec("0"), rec("1", key="one")], expected_range(2), key_equals_value=True)
    assert not v.ok and len(v.key_mismatches) == 1 and "key b'one'" in v.key_mismatches[0]
    assert check([rec("0"), rec("1", key="one")], expected_range(2)).ok  # keys unchecked unless asked


def test_an_open_transaction_under_the_prefix_fails_one_of_another_application_does_not() -> None:
    v = check(good_output(5), expected_range(5), [open_txn("demo--3"), open_txn("other-app-1")], prefix="demo-")
    assert not v.ok and v.open_transactions == ["demo--3 (producer id 7, epoch 3, Ongoing)"]
    assert check(good_output(5), expected_range(5), [open_txn("other-app-1")], prefix="demo-").ok


def test_the_expected_input_must_not_repeat_itself() -> None:
    with pytest.raises(ValueError, match="repeated: \\['1'\\]"):
        check([], ["0", "1", "1"])


def test_the_verifier_checks_a_recorded_dump_and_exits_by_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.jsonl"
    write_dump(good, [*good_output(6), rec(b"\x00binary", key=None, offset=9)], [])
    records, listed = read_dump(good)
    assert records[-1].value == b"\x00binary" and records[-1].key is None and listed == []
    assert records[0] == good_output(6)[0]  # bytes and headers survive the round trip

    exit_code = verify_output.main(["--from-dump", str(good), "--total-records", "6", "--json"])
    assert exit_code == 1  # the binary record is unexpected
    assert "unexpected (1 values)" in capsys.readouterr().out

    write_dump(good, good_output(6), [])
    assert verify_output.main(["--from-dump", str(good), "--total-records", "6"]) == 0
    assert capsys.readouterr().out.startswith("PASS")

    lingering = tmp_path / "lingering.jsonl"
    write_dump(lingering, good_output(6), [open_txn("demo--0")])
    assert verify_output.main(["--from-dump", str(lingering), "--total-records", "6", "--prefix", "demo-"]) == 1
    assert "open transactions (1): demo--0" in capsys.readouterr().out

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"topic": "t", "partition": 0}\n')
    with pytest.raises(ValueError, match="broken.jsonl:1: not a topic dump line"):
        read_dump(broken)


# --- (b) the simulation's Kafka model ------------------------------------------------------------

SEEDS = range(25)


@pytest.fixture(autouse=True)
def quiet_coordinator_logs() -> Iterator[None]:
    logging.disable(logging.WARNING)  # the simulation's injected failures are logged loudly
    yield
    logging.disable(logging.NOTSET)


def model_records(sim: Sim, *, uncommitted: bool = False) -> list[Record]:
    """The model's output topic as a consumer sees it (read_committed, or everything written: what
    read_uncommitted would deliver), provenance = the writing id."""
    tid_of = {m.producer_id: m.transactional_id for m in sim.model.txns.values()}
    if uncommitted:
        entries = [(p, e) for (t, p), log in sorted(sim.model.logs.items()) if t == sim.topic
                   for e in log if e.marker is None]
    else:
        entries = sim.model.read_committed_entries(sim.topic)
    return [Record(sim.topic, p, e.offset, None, (e.value or "").encode(),
                   (("transactional-id", tid_of[e.producer_id].encode()), ("producer-epoch", str(e.epoch).encode())))
            for p, e in entries]


def model_open(sim: Sim) -> list[OpenTransaction]:
    return [OpenTransaction(t.transactional_id, t.producer_id, t.producer_epoch, t.state, t.start_ms, t.timeout_ms)
            for t in sim.model.list_open(sim.prefix)]


def committed_input(sim: Sim) -> list[str]:
    return [r for b in sorted(sim.ckpt.commits) for r in sim.ckpt.offsets[b]]


def test_the_checker_passes_the_models_output_after_fault_schedules_and_fails_it_corrupted(engine: Engine) -> None:
    aborted_seen = 0
    for seed in SEEDS:
        result, sim = run_and_keep(engine, seed, FaultConfig(), keep_on_failure=False)
        assert result.ok, result.report()
        expected = committed_input(sim)
        verdict = check(model_records(sim), expected, model_open(sim), prefix=sim.prefix)
        assert verdict.ok, f"seed {seed}: {verdict.report()}"
        assert verdict.seen_count == len(expected)

        # every record written, aborted transactions included: fails exactly when some aborted
        # transaction wrote records, naming the aborted copy's transactional id
        everything = model_records(sim, uncommitted=True)
        verdict = check(everything, expected, prefix=sim.prefix)
        if len(everything) > len(expected):
            aborted_seen += 1
            assert not verdict.ok and (verdict.duplicates or verdict.unexpected), f"seed {seed}"
            committed_ids = {r for r in model_records(sim)}
            stray = next(r for r in everything if r not in committed_ids)
            where = verdict.duplicates.get(stray.text() or "") or verdict.unexpected.get(stray.text() or "")
            assert where and any(stray.where() == w for w in where), (seed, stray, verdict.report())
        else:
            assert verdict.ok

        if expected:  # a committed record dropped
            visible = model_records(sim)
            verdict = check(visible[1:], expected, prefix=sim.prefix)
            assert not verdict.ok and verdict.missing == [visible[0].text()]
    assert aborted_seen >= 5, f"only {aborted_seen} of {len(SEEDS)} schedules aborted a transaction with records"


def test_a_transaction_left_open_in_the_model_fails_until_it_is_aborted(engine: Engine) -> None:
    result, sim = run_and_keep(engine, 4, FaultConfig(), keep_on_failure=False)
    assert result.ok and sim.ckpt.commits
    expected = committed_input(sim)
    lingering = f"{sim.prefix}-999"
    pid, epoch = sim.model.init_producer_id(lingering, sim.timeout_ms)
    sim.model.produce(lingering, pid, epoch, sim.topic, 0, expected[0])  # a zombie's copy, never committed

    verdict = check(model_records(sim), expected, model_open(sim), prefix=sim.prefix)
    assert not verdict.ok
    assert verdict.open_transactions == [f"{lingering} (producer id {pid}, epoch {epoch}, Ongoing)"]
    assert not verdict.duplicates  # read_committed does not deliver the open transaction's record

    sim.model.init_producer_id(lingering, sim.timeout_ms)  # what the recovery loop's sweep does
    assert check(model_records(sim), expected, model_open(sim), prefix=sim.prefix).ok


# --- (c) the verifier against the real broker -------------------------------------------------------


def _transaction(bootstrap: str, tid: str, topic: str, values: list[str], *, commit: bool) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, "log_level": 0})
    producer.init_transactions(30)
    producer.begin_transaction()
    for v in values:
        producer.produce(topic, key=v, value=v, partition=int(v) % 3, headers=[("eos-batch-id", b"0")])
    assert producer.flush(30) == 0  # in the log before the transaction ends
    (producer.commit_transaction if commit else producer.abort_transaction)(30)


def verify(capsys: pytest.CaptureFixture[str], bootstrap: str, topic: str, total: int, prefix: str,
           settle_s: float = 2.0) -> tuple[int, str]:
    code = verify_output.main(["--bootstrap-servers", bootstrap, "--topic", topic, "--total-records", str(total),
                               "--prefix", prefix, "--settle-timeout-s", str(settle_s), "--read-timeout-s", "60"])
    return code, capsys.readouterr().out


def test_the_verifier_on_the_real_broker_counts_what_read_committed_sees(
    real_kafka: RealKafka, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Committed "0".."8" on three partitions, and an aborted transaction that wrote a copy of "3"
    and a "9": the verifier passes (the aborted records are in the log, not visible). A broken
    verifier that reads read_uncommitted counts the aborted records and must fail."""
    bootstrap = real_kafka.bootstrap
    topic = real_kafka.create_topic(3)
    prefix = f"demo-{uuid.uuid4().hex[:6]}-"
    _transaction(bootstrap, f"{prefix}0", topic, [str(i) for i in range(9)], commit=True)
    _transaction(bootstrap, f"{prefix}1", topic, ["3", "9"], commit=False)

    code, out = verify(capsys, bootstrap, topic, 9, prefix)
    assert code == 0 and out.startswith("PASS: 9 records read_committed, 9 expected"), out
    records = verify_output.consume_topic(bootstrap, topic, timeout_s=60, idle_s=0.5)
    assert {r.partition for r in records} == {0, 1, 2}
    assert all(r.headers == (("eos-batch-id", b"0"),) and r.key == r.value for r in records)

    # the deliberately broken variant: the same verifier reading read_uncommitted
    honest = verify_output.consume_topic
    monkeypatch.setattr(verify_output, "consume_topic", lambda *a, **kw: honest(
        *a, **{**kw, "client_config": {"isolation.level": "read_uncommitted"}}))
    code, out = verify(capsys, bootstrap, topic, 9, prefix)
    assert code == 1 and out.startswith("FAIL: 11 records read_committed, 9 expected"), out
    assert "'3' x2" in out and "unexpected (1 values)" in out and "'9'" in out
    monkeypatch.setattr(verify_output, "consume_topic", honest)

    with pytest.raises(LookupError, match="not found"):
        verify_output.consume_topic(bootstrap, f"no-such-topic-{uuid.uuid4().hex[:6]}", timeout_s=20)


def test_the_verifier_on_the_real_broker_catches_duplicates_missing_records_and_open_transactions(
    real_kafka: RealKafka, capsys: pytest.CaptureFixture[str]
) -> None:
    from coordinator.kafka.control_plane import KafkaTarget
    from coordinator.kafka.wire.control_plane import KafkaWireControlPlane

    bootstrap = real_kafka.bootstrap
    topic = real_kafka.create_topic(3)
    prefix = f"demo-{uuid.uuid4().hex[:6]}-"
    _transaction(bootstrap, f"{prefix}0", topic, [str(i) for i in range(6)], commit=True)

    code, out = verify(capsys, bootstrap, topic, 7, prefix)  # "6" was never written
    assert code == 1 and "missing (1): 6" in out, out

    _transaction(bootstrap, f"{prefix}1", topic, ["4"], commit=True)  # a second committed copy
    code, out = verify(capsys, bootstrap, topic, 6, prefix)
    assert code == 1 and "duplicated (1 values):" in out and "'4' x2" in out, out

    # a transaction left open under the prefix: listed, and it holds its partition's LSO
    stats = run_transactional_producer(bootstrap, f"{prefix}2", topic, partition=1, records=1)
    code, out = verify(capsys, bootstrap, topic, 6, prefix, settle_s=1.0)
    assert code == 1, out
    assert f"open transactions (1): {prefix}2 (producer id {stats.producer_id}" in out
    assert f"{topic}[1] last stable offset" in out and f"(held by producer id {stats.producer_id})" in out

    plane = KafkaWireControlPlane()
    try:
        plane.abort(KafkaTarget("demo", bootstrap, 60_000), f"{prefix}2")  # what the recovery loop's sweep does
    finally:
        plane.close()
    code, out = verify(capsys, bootstrap, topic, 6, prefix)
    assert code == 1 and "open transactions" not in out and "last stable offset" not in out  # only the duplicate
