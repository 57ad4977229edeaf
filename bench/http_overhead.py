#!/usr/bin/env python
"""What the HTTP layer costs per call, without the coordinator: server CPU per request (from /proc)
of a FastAPI app under uvicorn as `coordinator serve` runs it, for a sync route (FastAPI hands it
to anyio's thread pool) and an async one (runs on the event loop), on uvloop + httptools and on
asyncio + h11. The body is a small JSON document validated by pydantic, like a protocol call's.

    python bench/http_overhead.py                  # 4 variants x 2 routes, ~1 min
    python bench/http_overhead.py --seconds 3 --clients 4

Last lines: one `key=value` line per variant, e.g.
    http uvloop sync cpu_us_per_call=… calls_per_s=… p99_ms=…
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from measure import CLK_TCK, cpu_snapshot, figure_line, log, percentile  # noqa: E402
from protocol_clients import free_port  # noqa: E402

APP = '''
from fastapi import FastAPI
from pydantic import BaseModel, Field

class Body(BaseModel):
    generation: int = Field(ge=0)
    partition: int = Field(ge=0)
    task_attempt_id: int = Field(ge=0)

app = FastAPI()

@app.post("/sync")
def sync_route(body: Body) -> dict:
    return {"lease_id": body.partition, "transactional_id": "tx-" + str(body.partition)}

@app.post("/async")
async def async_route(body: Body) -> dict:
    return {"lease_id": body.partition, "transactional_id": "tx-" + str(body.partition)}
'''


def run_variant(app_dir: Path, loop: str, http: str, route: str, seconds: float, clients: int) -> dict[str, float]:
    import httpx

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "overhead_app:app", "--port", str(port), "--loop", loop, "--http", http,
         "--log-level", "warning", "--no-access-log"],
        cwd=app_dir, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/{route}"
    body = {"generation": 1, "partition": 3, "task_attempt_id": 12345}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(url, json=body, timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"uvicorn ({loop}, {http}) did not start") from None
                time.sleep(0.1)
        latencies: list[list[float]] = [[] for _ in range(clients)]
        end = time.monotonic() + seconds

        def client(i: int) -> None:
            with httpx.Client(timeout=10) as c:
                while time.monotonic() < end:
                    t0 = time.monotonic()
                    c.post(url, json=body).raise_for_status()
                    latencies[i].append((time.monotonic() - t0) * 1000.0)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        a, t0 = cpu_snapshot(proc.pid, None), time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        b, wall = cpu_snapshot(proc.pid, None), time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    calls = sum(len(x) for x in latencies)
    server_s = (b["server"] - a["server"]) / CLK_TCK
    return {"cpu_us_per_call": 1e6 * server_s / calls, "calls_per_s": calls / wall,
            "p99_ms": percentile([x for xs in latencies for x in xs], 99) or 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5, help="seconds per variant (default 5)")
    ap.add_argument("--clients", type=int, default=4, help="client threads, keep-alive each (default 4)")
    args = ap.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        app_dir = Path(d)
        (app_dir / "overhead_app.py").write_text(APP)
        lines = []
        for loop, http in (("uvloop", "httptools"), ("asyncio", "h11")):
            for route in ("sync", "async"):
                log(f"{loop} + {http}, {route} route, {args.clients} clients, {args.seconds:.0f} s")
                r = run_variant(app_dir, loop, http, route, args.seconds, args.clients)
                lines.append(figure_line(f"http {loop} {route}", **r))
    print(f"\nhttp_overhead: {os.cpu_count()} CPUs (shared), one uvicorn worker; server CPU per call from /proc")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
