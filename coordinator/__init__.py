"""Exactly-once transaction coordinator for Spark -> Kafka."""

__version__ = "0.1.0"
