"""Exactly-once transaction coordinator for Spark -> Kafka."""

__version__ = "0.1.0"

# Where the embedded default keeps its Postgres and generated admin token (COORDINATOR_DATA_DIR).
DEFAULT_DATA_DIR = ".coordinator-data"
