"""The exactly-once verdict on an output topic, without I/O.

Input: the records a `read_committed` consumer saw (topic, partition, offset, key, value, headers),
the values the job was given, and the broker's open transactions under the sink's
`transactional.id` prefix (KIP-664 ListTransactions). Output: a `Verdict` naming every missing
value, every value seen more than once (with where each copy came from: partition, offset and the
writer's provenance headers), every value nobody wrote, every record whose key is not its value
(the example job writes key = value), and every transaction left open. The e2e verifier
(`e2e/verify_output.py`) feeds it a live topic or a recorded dump; the tests feed it hand-made
dumps and the simulation's Kafka model.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.kafka.control_plane import OpenTransaction

# The headers the writer (sparkclient, `provenance.headers=true`) adds to every record.
PROVENANCE_HEADERS = ("eos-sink", "eos-batch-id", "eos-attempt", "eos-lease-id")


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = ()

    def text(self) -> str | None:
        """The value as text, or None when it is missing or not UTF-8."""
        if self.value is None:
            return None
        try:
            return self.value.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def where(self) -> str:
        """Where this copy sits and who wrote it: `topic[partition]@offset` and its provenance."""
        prov = {k: (v.decode("utf-8", "replace") if v is not None else None) for k, v in self.headers}
        shown = {k: prov[k] for k in PROVENANCE_HEADERS if k in prov} or prov
        tail = " " + " ".join(f"{k}={v}" for k, v in shown.items()) if shown else " (no provenance headers)"
        return f"{self.topic}[{self.partition}]@{self.offset}{tail}"


@dataclass
class Verdict:
    expected_count: int
    seen_count: int
    missing: list[str] = field(default_factory=list)
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # value -> where each copy is
    unexpected: dict[str, list[str]] = field(default_factory=dict)  # value (or repr) -> where
    key_mismatches: list[str] = field(default_factory=list)
    open_transactions: list[str] = field(default_factory=list)
    unstable_partitions: list[str] = field(default_factory=list)  # last stable offset below the high watermark

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicates or self.unexpected or self.key_mismatches
                    or self.open_transactions or self.unstable_partitions)

    def report(self, limit: int = 20) -> str:
        lines = [f"{'PASS' if self.ok else 'FAIL'}: {self.seen_count} records read_committed, "
                 f"{self.expected_count} expected"]
        if self.missing:
            lines.append(f"missing ({len(self.missing)}): {_short(self.missing, limit)}")
        if self.duplicates:
            lines.append(f"duplicated ({len(self.duplicates)} values):")
            lines += [f"  {v!r} x{len(w)}: " + "; ".join(w) for v, w in list(self.duplicates.items())[:limit]]
        if self.unexpected:
            lines.append(f"unexpected ({len(self.unexpected)} values):")
            lines += [f"  {v!r}: " + "; ".join(w) for v, w in list(self.unexpected.items())[:limit]]
        if self.key_mismatches:
            lines.append(f"key differs from value ({len(self.key_mismatches)}): {_short(self.key_mismatches, limit)}")
        if self.open_transactions:
            lines.append(f"open transactions ({len(self.open_transactions)}): {_short(self.open_transactions, limit)}")
        if self.unstable_partitions:
            lines.append(f"last stable offset below the high watermark ({len(self.unstable_partitions)}): "
                         f"{_short(self.unstable_partitions, limit)}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "expected_count": self.expected_count, "seen_count": self.seen_count,
                "missing": self.missing, "duplicates": self.duplicates, "unexpected": self.unexpected,
                "key_mismatches": self.key_mismatches, "open_transactions": self.open_transactions,
                "unstable_partitions": self.unstable_partitions}


def _short(items: Sequence[str], limit: int) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def expected_range(total_records: int) -> list[str]:
    """The example job's output for TOTAL_RECORDS=n: the decimal strings "0" .. "n-1"."""
    return [str(i) for i in range(total_records)]


def check(
    records: Iterable[Record],
    expected: Iterable[str],
    open_transactions: Iterable[OpenTransaction] = (),
    *,
    prefix: str = "",
    key_equals_value: bool = False,
    unstable_partitions: Iterable[str] = (),
) -> Verdict:
    """Compare what a read_committed consumer saw with what was written, exactly once each.

    `open_transactions` are those the broker listed; only ids under `prefix` count (other
    applications may share the broker). `key_equals_value` checks the example job's key.
    `unstable_partitions` names partitions whose last stable offset is below the high watermark
    (something still holds them: readers cannot see past it)."""
    wanted = list(expected)
    wanted_set = set(wanted)
    if len(wanted_set) != len(wanted):
        dup = sorted(v for v, n in Counter(wanted).items() if n > 1)
        raise ValueError(f"the expected input must list each value once; repeated: {dup[:10]}")
    copies: dict[str, list[Record]] = defaultdict(list)
    verdict = Verdict(expected_count=len(wanted), seen_count=0)
    for r in records:
        verdict.seen_count += 1
        value = r.text()
        if value is None:
            verdict.unexpected.setdefault(repr(r.value), []).append(r.where())
            continue
        copies[value].append(r)
        if key_equals_value and r.key != r.value:
            verdict.key_mismatches.append(f"key {r.key!r} at {r.where()}")
    for value, found in copies.items():
        if value not in wanted_set:
            verdict.unexpected[value] = [r.where() for r in found]
        elif len(found) > 1:
            verdict.duplicates[value] = [r.where() for r in found]
    verdict.missing = [v for v in wanted if v not in copies]
    verdict.open_transactions = [
        f"{t.transactional_id} (producer id {t.producer_id}, epoch {t.producer_epoch}, {t.state})"
        for t in open_transactions if t.transactional_id.startswith(prefix)
    ]
    verdict.unstable_partitions = list(unstable_partitions)
    return verdict


# --- recorded topic dumps (JSON lines) -------------------------------------------------------------
#
# One line per record: {"topic", "partition", "offset", "key", "value", "headers": [[name, value]]},
# bytes as UTF-8 text when they decode, else {"b64": "..."}; optionally one line
# {"open_transactions": [...]} with the broker's listing. `verify_output --dump FILE` writes one,
# `verify_output --from-dump FILE` checks one without a broker.


def _enc(b: bytes | None) -> Any:
    if b is None:
        return None
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        import base64

        return {"b64": base64.b64encode(b).decode("ascii")}


def _dec(x: Any) -> bytes | None:
    if x is None:
        return None
    if isinstance(x, dict):
        import base64

        return base64.b64decode(x["b64"])
    return str(x).encode("utf-8")


def write_dump(path: Path, records: Iterable[Record], open_transactions: Iterable[OpenTransaction] = ()) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"topic": r.topic, "partition": r.partition, "offset": r.offset, "key": _enc(r.key),
                                "value": _enc(r.value), "headers": [[k, _enc(v)] for k, v in r.headers]}) + "\n")
        f.write(json.dumps({"open_transactions": [
            {"transactional_id": t.transactional_id, "producer_id": t.producer_id,
             "producer_epoch": t.producer_epoch, "state": t.state} for t in open_transactions]}) + "\n")


def read_dump(path: Path) -> tuple[list[Record], list[OpenTransaction]]:
    records: list[Record] = []
    open_txns: list[OpenTransaction] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "open_transactions" in row:
                    open_txns += [OpenTransaction(t["transactional_id"], t["producer_id"], t["producer_epoch"],
                                                  t["state"], None, None) for t in row["open_transactions"]]
                    continue
                records.append(Record(row["topic"], int(row["partition"]), int(row["offset"]), _dec(row["key"]),
                                      _dec(row["value"]), tuple((k, _dec(v)) for k, v in row.get("headers", []))))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a topic dump line ({exc}): {line[:120]!r}") from exc
    return records, open_txns
