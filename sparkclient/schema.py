"""The batch DataFrame's schema: Spark's Kafka-sink columns, checked before anything is written.

`value` (string or binary) is required; `key` (string or binary), `topic` (string), `partition`
(int) and `headers` (array<struct<key: string, value: binary>>) are optional; other columns are
ignored, as by Spark's Kafka sink. A row whose `value` is null is written as a null value
(a tombstone), as by Spark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pyspark comes with Spark (or the [spark] extra), not with `pip install .`
    from pyspark.sql.types import DataType, StructType

KAFKA_COLUMNS = ("key", "value", "topic", "partition", "headers")
_EXPECTED = {
    "key": "string or binary",
    "value": "string or binary",
    "topic": "string",
    "partition": "int",
    "headers": "array<struct<key: string, value: binary>>",
}


class SchemaError(ValueError):
    """The batch DataFrame does not have Spark's Kafka-sink schema; names the column and type."""


@dataclass(frozen=True)
class KafkaColumns:
    """Which Kafka-sink columns the batch has (in this order in the rows the tasks receive)."""

    columns: tuple[str, ...]

    def index(self, name: str) -> int | None:
        return self.columns.index(name) if name in self.columns else None


def _headers_ok(t: DataType) -> bool:
    from pyspark.sql.types import ArrayType, BinaryType, StringType, StructType

    if not isinstance(t, ArrayType) or not isinstance(t.elementType, StructType):
        return False
    fields = {f.name: f.dataType for f in t.elementType.fields}
    return (set(fields) == {"key", "value"} and isinstance(fields["key"], StringType)
            and isinstance(fields["value"], BinaryType))


def _type_ok(name: str, t: DataType) -> bool:
    from pyspark.sql.types import BinaryType, IntegerType, StringType

    if name in ("key", "value"):
        return isinstance(t, (StringType, BinaryType))
    if name == "topic":
        return isinstance(t, StringType)
    if name == "partition":
        return isinstance(t, IntegerType)
    return _headers_ok(t)


def check_schema(schema: StructType, *, topic_option: str | None) -> KafkaColumns:
    """The Kafka-sink columns present, or SchemaError naming what to fix."""
    types = {f.name: f.dataType for f in schema.fields}
    twice = sorted({n for n in schema.names if n in KAFKA_COLUMNS and schema.names.count(n) > 1})
    if twice:
        raise SchemaError(f"the batch DataFrame has more than one column named {twice}: keep one of each "
                          f"(e.g. select or alias after a join); columns: {schema.names}")
    if "value" not in types:
        raise SchemaError(f"the batch DataFrame has no 'value' column (expected {_EXPECTED['value']}); "
                          f"columns: {list(types)}")
    for name in KAFKA_COLUMNS:
        if name in types and not _type_ok(name, types[name]):
            raise SchemaError(f"column {name!r} has type {types[name].simpleString()}; expected {_EXPECTED[name]}"
                              + ("; cast it, e.g. col('value').cast('string')" if name in ("key", "value") else ""))
    if topic_option is None and "topic" not in types:
        raise SchemaError("no topic: set the 'topic' option or add a 'topic' column (string)")
    return KafkaColumns(tuple(n for n in KAFKA_COLUMNS if n in types))
