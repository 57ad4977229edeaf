"""PySpark exactly-once Kafka writer: `df.writeStream.foreachBatch(ExactlyOnceKafkaWriter({...}))`.

The driver side is `writer.py`, the executor side `executor.py`, the coordinator's HTTP client
`client.py`, options `options.py`, the batch schema rules `schema.py`.
"""

from .client import CoordinatorClient, CoordinatorError
from .executor import HEADER_ATTEMPT, HEADER_BATCH, HEADER_LEASE, HEADER_SINK, DeliveryFailed
from .options import WriterOptionError, WriterOptions
from .schema import SchemaError
from .writer import BatchReport, ExactlyOnceKafkaWriter, LineageError

__all__ = [
    "BatchReport", "CoordinatorClient", "CoordinatorError", "DeliveryFailed", "ExactlyOnceKafkaWriter",
    "HEADER_ATTEMPT", "HEADER_BATCH", "HEADER_LEASE", "HEADER_SINK", "LineageError", "SchemaError",
    "WriterOptionError", "WriterOptions",
]
