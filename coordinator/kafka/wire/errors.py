"""How the wire control plane reads Kafka's error codes: which are retried (and which mean the cached
transaction coordinator must be looked up again) and which refuse for good."""

from __future__ import annotations

import kafka.errors as Errors

from ..control_plane import ControlPlaneError

_NONE = Errors.NoError.errno
# answered by the broker when the request reached the wrong (or a not yet ready) coordinator:
# forget the cached coordinator and look it up again
_REFIND = {Errors.NotCoordinatorError.errno, Errors.CoordinatorNotAvailableError.errno}
_REFIND_NAMES = {"not_coordinator", "coordinator_not_available"}
# transient answers worth repeating as they are
_RETRY = {
    Errors.CoordinatorLoadInProgressError.errno,
    Errors.ConcurrentTransactionsError.errno,
    Errors.RequestTimedOutError.errno,
    Errors.NetworkExceptionError.errno,
    Errors.ThrottlingQuotaExceededError.errno,
}


class _Retry(Exception):
    """One attempt failed in a way worth retrying."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


def _error_name(errno: int) -> str:
    if errno == Errors.UnknownError.errno:
        return "unknown_server_error"  # Kafka's name; kafka-python calls it UNKNOWN
    cls = Errors.for_code(errno)
    message = getattr(cls, "message", None)
    if message and message != "UNKNOWN":
        return str(message).lower()
    return f"kafka_error_{errno}"


def _is_retriable_code(errno: int) -> bool:
    if errno in _REFIND or errno in _RETRY:
        return True
    if errno in Errors.kafka_errors:
        return bool(Errors.kafka_errors[errno].retriable)
    return False  # unknown to kafka-python: not known to be transient


def _check(error_code: int, what: str) -> None:
    """Raise _Retry for transient broker answers, ControlPlaneError for refusals."""
    if error_code == _NONE:
        return
    name = _error_name(error_code)
    if _is_retriable_code(error_code):
        raise _Retry(name, f"{what}: broker answered {name.upper()} ({error_code})")
    raise ControlPlaneError(f"{what}: broker answered {name.upper()} ({error_code})", retriable=False, code=name)


REFIND = "refind"  # look the transaction coordinator up again before the next try
DISCARD = "discard"  # the connection manager is broken (socket trouble, its IO loop died): start afresh


def classify_failure(exc: Exception, what: str, key: str) -> tuple[str, str, str | None]:
    """What one failed try means: (code, detail, what to do before the next try: REFIND, DISCARD or
    None). Raises the ControlPlaneError that ends the call for a refusal, and re-raises what no
    try is expected to fail with."""
    if isinstance(exc, ControlPlaneError):
        raise exc
    if isinstance(exc, _Retry):
        return exc.code, str(exc), REFIND if exc.code in _REFIND_NAMES else None
    if isinstance(exc, Errors.KafkaError):
        if isinstance(exc, Errors.BrokerResponseError) and not exc.retriable:
            # e.g. an authorization or SASL failure surfaced by the connection layer
            name = exc.message.lower() if exc.message else type(exc).__name__
            raise ControlPlaneError(f"{what} of {key!r}: {exc}", retriable=False, code=name) from exc
        code = "request_timed_out" if isinstance(exc, (Errors.KafkaTimeoutError, Errors.RequestTimedOutError)) \
            else "network_exception"
        return code, f"{what} of {key!r}: {type(exc).__name__}: {exc}", REFIND  # the coordinator may have moved or died
    if isinstance(exc, (OSError, RuntimeError)):
        return "network_exception", f"{what} of {key!r}: {type(exc).__name__}: {exc}", DISCARD
    raise exc
