"""The Kafka adapter: the control-plane interface the service acts through (control_plane.py), its
implementation on Kafka's wire protocol (wire/), reading a transaction's outcome from the log
(outcome.py) and the interpretation of broker observations (broker.py). It imports the protocol
core, never the service or the HTTP layer."""
