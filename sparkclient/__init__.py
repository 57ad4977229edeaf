"""PySpark exactly-once Kafka writer, two ways in:

- Spark 4.1+: the native streaming sink, `.writeStream.format("kafka_eos")` after
  `sparkclient.sink.register_sink(spark)` (sink.py, sink_runs.py): the one-line switch from
  Spark's own Kafka sink;
- any Spark (3.5, 4.x): `df.writeStream.foreachBatch(ExactlyOnceKafkaWriter({...}))` (writer.py,
  jobs.py).

Both run the same executor core on Arrow record batches (executor.py: the task's lease and checks;
transaction.py: the Kafka transaction; produce.py: the records) and commit the same way
(commit.py). The coordinator's HTTP client is client.py, options options.py, the input schema
schema.py, checkpoint files checkpoint_files.py, the session settings session_settings.py.
"""

from .client import CoordinatorClient, CoordinatorError
from .commit import BatchReport
from .options import WriterOptionError, WriterOptions
from .produce import HEADER_ATTEMPT, HEADER_BATCH, HEADER_LEASE, HEADER_SINK
from .schema import SchemaError
from .transaction import DeliveryFailed
from .writer import ExactlyOnceKafkaWriter, LineageError

__all__ = [
    "BatchReport", "CoordinatorClient", "CoordinatorError", "DeliveryFailed", "ExactlyOnceKafkaWriter",
    "HEADER_ATTEMPT", "HEADER_BATCH", "HEADER_LEASE", "HEADER_SINK", "LineageError", "SchemaError",
    "WriterOptionError", "WriterOptions",
]
