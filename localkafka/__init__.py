"""A real Apache Kafka on loopback for tests, benchmarks, the example job and users without Docker:
Kafka's own server jars resolved by Maven (localkafka/maven.py) and run as a KRaft cluster of one
or three nodes (localkafka/cluster.py). Command line: `python -m localkafka --help`."""

from .cluster import KafkaNode, LocalKafka, LocalKafkaError, free_port
from .maven import KAFKA_VERSIONS, MavenError, default_kafka_version, kafka_classpath, spark_kafka_jars

__all__ = [
    "KAFKA_VERSIONS",
    "KafkaNode",
    "LocalKafka",
    "LocalKafkaError",
    "MavenError",
    "default_kafka_version",
    "free_port",
    "kafka_classpath",
    "spark_kafka_jars",
]
