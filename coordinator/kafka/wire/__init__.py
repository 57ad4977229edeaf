"""The Kafka control plane on Kafka's wire protocol (kafka-python's protocol classes), split by
concern: the connection and retry layer, the request builders and response parsers, the
broker-check verdicts, and the control plane that puts them together."""
