"""The Kafka adapter: the control-plane interface the service acts through (control_plane.py), its
implementation on Kafka's wire protocol (wire/), reading a transaction's outcome from the log
(outcome.py) and the interpretation of broker observations (broker.py). It imports the protocol
core, never the service or the HTTP layer.

`build_control_plane` picks the implementation from the settings. It lives here, where both the
interface and its implementations are known, so that the interface (control_plane.py) never imports
an implementation and the wire code is imported only when it is chosen.
"""

from __future__ import annotations

import logging
from typing import Any

from .control_plane import KafkaControlPlane, RecordingControlPlane

log = logging.getLogger(__name__)


def build_control_plane(kind: str | None, **kafka_options: Any) -> KafkaControlPlane | None:
    """`None` (not configured): the service runs, but refuses to decide commits (503) and leaves
    aborts pending, because it cannot act on Kafka. "none": the recording test mode. "kafka": the
    real control plane on Kafka's wire protocol (coordinator/kafka/wire/), built with
    `kafka_options` (timeouts, retry budget, client security settings)."""
    if kind is None:
        log.warning(
            "no Kafka control plane is configured (COORDINATOR_KAFKA_CONTROL_PLANE): commits will "
            "be refused with 503 and aborts stay pending until one is configured"
        )
        return None
    if kind == "none":
        log.warning(
            "COORDINATOR_KAFKA_CONTROL_PLANE=none: commits and aborts are recorded but NEVER sent "
            "to Kafka. This mode is for tests only; never use it in production."
        )
        return RecordingControlPlane(keep_history=False)  # a server's lists nobody reads would only grow
    if kind == "kafka":
        from .wire.control_plane import KafkaWireControlPlane  # imports kafka-python only when chosen

        return KafkaWireControlPlane(**kafka_options)
    raise ValueError(f"unknown Kafka control plane {kind!r}")
