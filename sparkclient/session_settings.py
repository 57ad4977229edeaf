"""The Spark session settings that decide a small batch's fixed cost, and the one warning the
writer gives when the setting is off.

`spark.python.unix.domain.socket.enabled=true` (Spark 4.0+) makes the JVM talk to its Python
workers over a Unix domain socket instead of loopback TCP; with TCP every Python task of a small
batch stalled ~40 ms on the socket (measured: bench/writer_task_breakdown.py, issue 49). It is a
setting of the session (the Spark context's configuration), so the writer cannot set it: the docs,
the example job and the quickstart set it, and the writer says once per process when it is off.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

SOCKET_SETTING = "spark.python.unix.domain.socket.enabled"
RECOMMENDED_CONF = {SOCKET_SETTING: "true"}
_warned = False


def _supported(version: str) -> bool:
    try:
        return int(version.split(".")[0]) >= 4
    except ValueError:
        return False


def socket_setting_is_off(spark: Any) -> bool:
    """On the driver: whether the session's Python workers use loopback TCP though Unix domain
    sockets are available (Spark 4.0+)."""
    if not _supported(str(getattr(spark, "version", "0"))):
        return False
    try:
        value = spark.conf.get(SOCKET_SETTING, "false")
    except Exception:  # noqa: BLE001 - a Connect server that refuses to read it: say nothing
        return False
    return str(value).lower() != "true"


def worker_socket_is_off() -> bool:
    """In a Python worker Spark started (executor task, or the driver's data source processes):
    Spark puts PYTHON_UNIX_DOMAIN_ENABLED in its environment when the setting is on."""
    import pyspark

    return _supported(pyspark.__version__) and os.environ.get("PYTHON_UNIX_DOMAIN_ENABLED", "").lower() != "true"


def say_socket_setting_is_off() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("%s is off: every Python task of a small batch waits ~40 ms on the loopback socket between the "
                    "JVM and its Python worker. Set %s=true when building the Spark session "
                    "(docs/spark.md#small-batches)", SOCKET_SETTING, SOCKET_SETTING)


def warn_if_slow_worker_socket(spark: Any) -> None:
    if not _warned and socket_setting_is_off(spark):
        say_socket_setting_is_off()
