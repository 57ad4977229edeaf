"""Deterministic, seeded fault-injection simulation of Spark -> coordinator -> Kafka (issue 5)."""
