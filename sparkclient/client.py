"""HTTP client of the coordinator's REST API v1, used by the driver and by every executor task.

Every protocol call is idempotent on the service side (the same request finds its earlier effect
and answers the same), so connection failures, timeouts and 5xx answers are retried with capped
exponential backoff and full jitter until a time budget runs out. 4xx answers are not retried: they
raise `CoordinatorError` carrying the service's reason, message and detail plus what to do.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import httpx

log = logging.getLogger(__name__)

TOO_MANY_REQUESTS = 429  # from a proxy or gateway in front of the coordinator


def is_retried(status: int) -> bool:
    """Every 5xx (the coordinator's 503s and any proxy's) and 429; never another 4xx (a refusal
    that a retry would only repeat)."""
    return status >= 500 or status == TOO_MANY_REQUESTS

# what the user should do, by the service's error reason (coordinator/protocol/errors.py)
_HINTS = {
    "lineage_mismatch": "this sink is bound to another query (another checkpoint location). Restart from the "
    "original checkpoint location, or have an operator reset the lineage "
    "(POST /v1/sinks/{sink}/lineage/reset) if the new query is meant to take over",
    "stale_generation": "a newer run of this query took over the sink; this driver is fenced and must stop",
    "sink_halted_lost_data": "an operator must acknowledge the lost data "
    "(POST /v1/sinks/{sink}/lost-data/acknowledge) before the query can continue",
    "transaction_deadline_too_close": "the batch took too long for the sink's transaction timeout; the batch "
    "was aborted and is replayed when the query restarts. Raise transaction_timeout_ms or make batches smaller",
    "unknown_sink": "register the sink first (POST /v1/sinks with the admin token) or fix the sink name",
    "forbidden": "use the sink's writer token (returned when the sink was registered) or the admin token",
    "unauthenticated": "pass the sink's writer token as coordinator.token",
    "pool_exhausted": "more concurrent tasks than the sink's transactional id pool; raise max_pool_size",
}


class CoordinatorError(RuntimeError):
    """The coordinator refused a call (4xx), or did not answer within the retry budget."""

    def __init__(self, status: int | None, reason: str, message: str, detail: dict[str, Any] | None = None,
                 *, call: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.detail = detail or {}
        self.call = call
        hint = _HINTS.get(reason)
        text = f"coordinator {call}: {reason} (HTTP {status}): {message}" if status else f"coordinator {call}: {message}"
        super().__init__(text + (f" -- what to do: {hint}" if hint else ""))


class CoordinatorClient:
    """One sink's protocol calls. Thread-safe; executors keep one per Python worker (executor.TaskSpec.client)."""

    def __init__(self, url: str, token: str, sink: str, *, timeout_s: float = 30.0, retry_budget_s: float = 120.0,
                 backoff_base_s: float = 0.2, backoff_max_s: float = 5.0) -> None:
        self.sink = sink
        self.retry_budget_s = retry_budget_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._http = httpx.Client(
            base_url=url.rstrip("/"),
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            headers={"Authorization": f"Bearer {token}"},
            # a plain-HTTP URL needs no TLS context (building one costs ~20 ms of CPU, once per task)
            verify=not url.startswith("http://"),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport ------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        """Send with retries; return the decoded JSON of a 2xx answer."""
        call = f"{method} {path}"
        deadline = time.monotonic() + self.retry_budget_s
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = self._http.request(method, path, json=body, **kwargs)
            except (httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:  # a retry would fail the same way
                raise CoordinatorError(None, "bad_url", f"{exc}; check coordinator.url ({self._http.base_url}): it "
                                       "must be the coordinator's http:// or https:// base URL", call=call) from exc
            except httpx.TransportError as exc:  # connection refused/reset, timeouts: the call may be repeated
                failure: str = f"{type(exc).__name__}: {exc}"
            else:
                if 200 <= resp.status_code < 300:
                    return _json_of(resp, call)
                if 300 <= resp.status_code < 400:
                    raise CoordinatorError(resp.status_code, "redirect", f"the coordinator URL answered a redirect "
                                           f"to {resp.headers.get('location')!r}; set coordinator.url to the "
                                           "coordinator's own base URL", call=call)
                error = _error_of(resp)
                if not is_retried(resp.status_code):
                    raise CoordinatorError(resp.status_code, error.get("reason", "error"), error.get("message", resp.text),
                                           error.get("detail"), call=call)
                failure = f"HTTP {resp.status_code} {error.get('reason')}: {error.get('message')}"
            pause = random.uniform(0, min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1)))
            if time.monotonic() + pause > deadline:
                raise CoordinatorError(None, "unavailable", f"no answer after {attempt} tries in "
                                       f"{self.retry_budget_s:.0f} s (last: {failure}); check that the coordinator at "
                                       f"{self._http.base_url} is up and reachable", call=call)
            log.warning("coordinator %s failed (%s); retry %d in %.2f s", call, failure, attempt, pause)
            time.sleep(pause)

    # --- sinks ----------------------------------------------------------------------------------

    def describe_sink(self) -> dict[str, Any]:
        return self.request("GET", f"/v1/sinks/{self.sink}")

    def register_sink(self, transactional_id_prefix: str, bootstrap_servers: str, topics: list[str],
                      transaction_timeout_ms: int = 60_000, **extra: Any) -> dict[str, Any]:
        """Admin token only. Idempotent: the same configuration answers the same sink and writer token."""
        body = {"name": self.sink, "transactional_id_prefix": transactional_id_prefix,
                "bootstrap_servers": bootstrap_servers, "topics": topics,
                "transaction_timeout_ms": transaction_timeout_ms, **extra}
        return self.request("POST", "/v1/sinks", body)

    # --- protocol -------------------------------------------------------------------------------

    def start_generation(self, query_id: str, run_id: str) -> dict[str, Any]:
        return self.request("POST", f"/v1/sinks/{self.sink}/generations", {"query_id": query_id, "run_id": run_id})

    def begin(self, batch_id: int, generation: int, *, partitions: int | None = None,
              offsets: str | None = None) -> dict[str, Any]:
        """With `partitions`, the coordinator takes one id per partition for the partitions' first
        tries (each try still asks the lease route, which answers the pre-lease to the first try
        that claims it); `offsets` (a digest of Spark's offsets entry) binds the batch to what it reads."""
        body: dict[str, Any] = {"generation": generation}
        if partitions is not None:
            body["partitions"] = partitions
        if offsets is not None:
            body["offsets"] = offsets
        return self.request("POST", f"/v1/sinks/{self.sink}/checkpoints/{batch_id}/begin", body)

    def lease(self, batch_id: int, attempt: int, generation: int, partition: int, task_attempt_id: int) -> dict[str, Any]:
        body = {"generation": generation, "partition": partition, "task_attempt_id": task_attempt_id}
        return self.request("POST", f"/v1/sinks/{self.sink}/checkpoints/{batch_id}/attempts/{attempt}/leases", body)

    def commit(self, batch_id: int, attempt: int, generation: int, winners: dict[int, int | None],
               job_ms: int | None = None, *, records: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
        """`winners`: every partition 0..N-1 -> its winning lease id, None for an empty partition.
        `records`: partition -> the winner's pre-commit record from its task result
        (task_attempt_id: the try that claimed the lease, producer_id, producer_epoch, records,
        bytes, write_ms, first_offsets); stored with the decision."""
        records = records or {}
        body = {"generation": generation, "job_ms": job_ms,
                "partitions": [{"partition": p, "lease_id": lid, **(records.get(p) or {})}
                               for p, lid in sorted(winners.items())]}
        return self.request("POST", f"/v1/sinks/{self.sink}/checkpoints/{batch_id}/attempts/{attempt}/commit", body)

    def abort(self, batch_id: int, attempt: int, generation: int, reason: str) -> dict[str, Any]:
        body = {"generation": generation, "reason": reason[:500]}
        return self.request("POST", f"/v1/sinks/{self.sink}/checkpoints/{batch_id}/attempts/{attempt}/abort", body)

    def checkpoint(self, batch_id: int, page_size: int = 1000) -> dict[str, Any]:
        """The checkpoint, its attempts and every lease (the service answers them a page at a time)."""
        path = f"/v1/sinks/{self.sink}/checkpoints/{batch_id}"
        detail = self.request("GET", path, params={"lease_limit": page_size})
        while detail.get("next_after_lease_id") is not None:
            page = self.request("GET", path, params={"lease_limit": page_size,
                                                     "after_lease_id": detail["next_after_lease_id"]})
            detail = {**page, "leases": detail["leases"] + page["leases"]}
        return detail

    def checkpoints(self, state: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        return self.request("GET", f"/v1/sinks/{self.sink}/checkpoints", params=params)


def _json_of(resp: httpx.Response, call: str) -> Any:
    try:
        return resp.json()
    except ValueError:
        raise CoordinatorError(resp.status_code, "not_json", f"the answer is not JSON "
                               f"({resp.headers.get('content-type')}: {resp.text[:200]!r}); check coordinator.url: "
                               "is it the coordinator, not a proxy's login or error page?", call=call) from None


def _error_of(resp: httpx.Response) -> dict[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        return {"reason": "error", "message": resp.text[:500]}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {"reason": "error", "message": resp.text[:500]}
