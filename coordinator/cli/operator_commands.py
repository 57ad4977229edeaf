"""The operator commands (`coordinator sinks|checkpoints|checkpoint|transactions|commit|abort|acknowledge|retire|
prune-history`): a few REST API v1 calls against a running coordinator with the admin token,
printed as a table or as the API's JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .. import DEFAULT_DATA_DIR


def data_dir() -> Path:
    """COORDINATOR_DATA_DIR (read without the server's settings stack, which a client-only install lacks)."""
    return Path(os.environ.get("COORDINATOR_DATA_DIR") or DEFAULT_DATA_DIR)


def _segment(value: str) -> str:
    """A path segment of the API's URLs (a sink name is checked, but quote all the same)."""
    return quote(value, safe="")


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class AdminApi:
    """The few REST API v1 calls the operator commands make, with the admin token."""

    def __init__(self, url: str, token: str, timeout_s: float = 60.0) -> None:
        import httpx

        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {token}"})

    def call(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        import httpx

        try:
            resp = self.http.request(method, path, json=body, params={k: v for k, v in params.items() if v is not None})
        except httpx.HTTPError as exc:
            raise ApiError(0, "unreachable", f"{method} {self.http.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                err = resp.json()["error"]
                raise ApiError(resp.status_code, err["reason"], err["message"])
            except (ValueError, KeyError, TypeError):
                raise ApiError(resp.status_code, f"http_{resp.status_code}", resp.text[:500]) from None
        # Not the coordinator's API (a login page, a proxy's redirect, another service): say where
        # the answer came from instead of failing to decode it.
        check = "check that --url (or COORDINATOR_URL) points at the coordinator itself, not a proxy or another service"
        if resp.is_redirect:
            raise ApiError(resp.status_code, "not_coordinator",
                           f"{method} {resp.url} answered {resp.status_code} redirecting to "
                           f"{resp.headers.get('location', '(no Location)')}; {check}")
        try:
            return resp.json()
        except ValueError:
            raise ApiError(resp.status_code, "not_coordinator",
                           f"{method} {resp.url} answered {resp.status_code} with "
                           f"{resp.headers.get('content-type', 'no content type')}, not JSON; {check}") from None


def _is_local(url: str) -> bool:
    from urllib.parse import urlsplit

    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


def _api(args: argparse.Namespace) -> AdminApi:
    url = args.url or os.environ.get("COORDINATOR_URL") or "http://127.0.0.1:8000"
    token = args.token or os.environ.get("COORDINATOR_ADMIN_TOKEN")
    token_file = data_dir() / "admin-token"
    if not token and _is_local(url) and token_file.exists():
        # the token the embedded default wrote; only sent to a coordinator on this machine
        token = token_file.read_text().strip()
    if not token:
        raise ApiError(0, "no_token", "give --token or set COORDINATOR_ADMIN_TOKEN (the coordinator's admin token); "
                       f"for a coordinator on this machine, {token_file} is read when it exists")
    return AdminApi(url, token)


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def sinks_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    data = _api(args).call("GET", "/v1/sinks")
    rows = [{**s, "topics": ",".join(s["topics"]), "halted": "HALTED" if s["halted"] else ""} for s in data]
    return data, _table(rows, ["name", "transactional_id_prefix", "bootstrap_servers", "topics",
                               "transaction_timeout_ms", "generation", "halted"])


def checkpoints_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    data = _api(args).call("GET", f"/v1/sinks/{_segment(args.sink)}/checkpoints", state=args.state, limit=args.limit)
    return data, _table(data, ["batch_id", "state", "current_attempt", "committed_attempt", "created_at",
                               "committed_at", "lost_reason"])


def checkpoint_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    """One batch: its state, what its winners wrote, its attempts and its lease count by state;
    with --leases or --lease-state, its leases too (of that state), every page of them."""
    api, path = _api(args), f"/v1/sinks/{_segment(args.sink)}/checkpoints/{args.batch_id}"
    listing = args.leases or args.lease_state is not None
    data = api.call("GET", path, lease_state=args.lease_state, lease_limit=1000 if listing else 1)
    if listing:
        while data["next_after_lease_id"] is not None:
            page = api.call("GET", path, lease_state=args.lease_state,
                            after_lease_id=data["next_after_lease_id"])
            data = {**page, "leases": data["leases"] + page["leases"]}
    else:
        data = {**data, "leases": []}
    data.pop("next_after_lease_id")
    cp = data["checkpoint"]
    wrote = (f"{data['records']} records, {data['bytes']} bytes" if data["records"] is not None
             else f"history pruned at {cp['history_pruned_at']}" if cp.get("history_pruned_at") else "nothing decided yet")
    decided = f" (attempt {cp['committed_attempt']} decided)" if cp["committed_attempt"] else ""
    lines = [f"batch {cp['batch_id']}: {cp['state']}{decided}; {wrote}",
             "leases: " + (", ".join(f"{n} {state}" for state, n in data["lease_counts"].items()) or "none"),
             "", _table(data["attempts"], ["number", "state", "generation", "partitions", "started_at", "decided_at",
                                           "finished_at", "abort_reason"])]
    if cp.get("lost_reason"):
        lines.insert(1, f"lost: {cp['lost_reason']}")
    if listing:
        lines += ["", _table(data["leases"], ["lease_id", "attempt", "partition", "task_attempt_id", "transactional_id",
                                              "state", "producer_id", "producer_epoch", "records", "bytes"])]
    return data, "\n".join(lines)


def transactions_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    data = _api(args).call("GET", f"/v1/sinks/{_segment(args.sink)}/transactions/open")
    now = datetime.now(timezone.utc)
    rows = []
    for x in data:
        leased, deadline = _parse_time(x["leased_at"]), _parse_time(x["deadline_at"])
        age_s = (now - leased).total_seconds()
        timeout_s = (deadline - leased).total_seconds()
        x["age_s"] = round(age_s, 1)
        x["timeout_s"] = round(timeout_s, 1)
        x["age_pct"] = round(100 * age_s / timeout_s) if timeout_s > 0 else None
        rows.append(x)
    return data, _table(rows, ["lease_id", "partition", "transactional_id", "state", "producer_id", "producer_epoch",
                               "records", "age_s", "timeout_s", "age_pct"])


def commit_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    data = _api(args).call("POST", f"/v1/sinks/{_segment(args.sink)}/checkpoints/{args.batch_id}/resume")
    text_ = (f"batch {data['batch_id']}: {data['state']} by attempt {data['attempt']}; "
             f"{len(data['committed'])} partition(s) committed, {len(data['aborted'])} transaction(s) aborted, "
             f"{len(data['abort_pending'])} abort(s) pending")
    return data, "\n".join([text_, *data.get("warnings", [])])


def abort_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    data = _api(args).call("POST", f"/v1/sinks/{_segment(args.sink)}/checkpoints/{args.batch_id}/attempts/{args.attempt}/abort",
                           {"reason": args.reason})
    a = data["attempt"]
    return data, (f"batch {args.batch_id} attempt {a['number']}: {a['state']}; "
                  f"aborted {data['aborted'] or 'nothing'}; pending {data['abort_pending'] or 'nothing'}")


def acknowledge_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    body = {"reason": args.reason, **({"operator": args.operator} if args.operator else {})}
    data = _api(args).call("POST", f"/v1/sinks/{_segment(args.sink)}/lost-data/acknowledge", body)
    if data["acknowledged"]:
        return data, f"sink {args.sink}: lost data acknowledged (lost batches {data['lost_batches']}); the halt is cleared"
    return data, f"sink {args.sink} was not halted: nothing to acknowledge"


def retire_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    data = _api(args).call("POST", f"/v1/sinks/{_segment(args.sink)}/retire", {"reason": args.reason})
    return data, f"sink {data['name']} retired at {data['retired_at']}; its records and event trail are kept"


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def duration_s(raw: str) -> int:
    """`30d`, `12h`, `90m` or `3600s` (a bare number is seconds), as whole seconds."""
    text_ = raw.strip().lower()
    unit = text_[-1:] if text_[-1:] in _UNITS else "s"
    number = text_[:-1] if text_[-1:] in _UNITS else text_
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a duration like 30d, 12h, 90m or 3600s") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{raw!r}: a duration is not negative")
    return round(value * _UNITS[unit])


def chunk_size(raw: str) -> int:
    """Batches per pruning transaction: 1-5000 (the API's bounds)."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 5_000:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number of batches from 1 to 5000")
    return value


def prune_history_cmd(args: argparse.Namespace) -> tuple[Any, str]:
    """Prune chunk by chunk until nothing is left, with progress on stderr (a dry run: one count)."""
    api = _api(args)
    body = {"older_than_s": args.older_than, "limit": args.batch_size, **({"sink": args.sink} if args.sink else {})}
    plan = api.call("POST", "/v1/history/prune", {**body, "dry_run": True})
    scope = f"sink {args.sink}" if args.sink else "all sinks"
    if args.dry_run or not plan["candidates"]:
        by_sink = ", ".join(f"{k}: {v}" for k, v in sorted(plan["by_sink"].items())) or "none"
        return plan, (f"{plan['candidates']} committed batch(es) of {scope} committed before {plan['cutoff']} "
                      f"would lose their history ({by_sink})")
    total = {"pruned": 0, "attempts": 0, "leases": 0, "events": 0}
    while True:
        chunk = api.call("POST", "/v1/history/prune", body)
        for k in total:
            total[k] += chunk[k]
        print(f"pruned {total['pruned']} of ~{plan['candidates']} batch(es)", file=sys.stderr, flush=True)
        if not chunk["more"] or not chunk["pruned"]:
            break
    return {**total, "cutoff": plan["cutoff"]}, (
        f"pruned the history of {total['pruned']} committed batch(es) of {scope} committed before {plan['cutoff']}: "
        f"{total['attempts']} attempt(s), {total['leases']} lease(s), {total['events']} event(s); "
        "their checkpoint rows stay")


def operator_cmd(fn: Callable[[argparse.Namespace], tuple[Any, str]]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            data, text_ = fn(args)
        except ApiError as exc:
            print(f"coordinator {args.command}: {exc.reason}: {exc.message}", file=sys.stderr)
            return 1
        print(json.dumps(data, indent=2) if args.json else text_)
        return 0

    return run
