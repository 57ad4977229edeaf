"""Log volume bounded when something stays broken: a record that repeats one already logged
(same logger, level and subject) within `interval_s` is dropped, and the next one let through says
how many were not shown. The subject is the broker addresses (host:port) a line names, or else its
text with the numbers taken out: an unreachable broker gives one line per logger and level per
interval, however often the clients retry."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable

# Loggers whose lines repeat per retry while a broker is down: kafka-python's connection chatter,
# the wire control plane's retries, the recovery loop's failing steps, the dashboard's broker watch.
REPEATING = ("kafka", "coordinator.kafka", "coordinator.service.recovery", "coordinator.service.broker_checks",
             "coordinator.http.dashboard")
_ADDRESS = re.compile(r"\b[\w.-]+:\d{2,5}\b")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def subject(message: str) -> str:
    addresses = sorted(set(_ADDRESS.findall(message)))
    return ",".join(addresses) if addresses else _NUMBER.sub("#", message)


class RepeatLimit(logging.Filter):
    def __init__(self, interval_s: float = 60.0, prefixes: Iterable[str] = REPEATING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.prefixes = tuple(prefixes)
        self.clock = clock
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.prefixes):
            return True
        message = record.getMessage()
        key = (record.name, record.levelno, subject(message))
        now = self.clock()
        with self._lock:
            last, suppressed = self._seen.get(key, (None, 0))
            if last is not None and now - last < self.interval_s:
                self._seen[key] = (last, suppressed + 1)
                return False
            self._seen[key] = (now, 0)
            if len(self._seen) > 10_000:  # many distinct subjects: forget the oldest half
                for k in sorted(self._seen, key=lambda k: self._seen[k][0])[:5_000]:
                    del self._seen[k]
        if suppressed:
            record.msg = f"{message} ({suppressed} similar line(s) in the last {now - last:.0f} s not shown)"
            record.args = ()
        return True


def limit_repeats(level: str = "info", interval_s: float = 60.0) -> None:
    """Install the filter on the root logger's handlers (once), and keep kafka-python's per-connection
    INFO lines out unless the log level is debug."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatLimit) for f in handler.filters):
            handler.addFilter(RepeatLimit(interval_s))
    if level.lower() != "debug":
        logging.getLogger("kafka").setLevel(logging.WARNING)
