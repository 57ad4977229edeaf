#!/usr/bin/env python
"""What the HTTP layer costs per call: server CPU per request (from /proc).

1. Without the coordinator: a FastAPI app under uvicorn as `coordinator serve` runs it, for a sync
   route (FastAPI hands it to anyio's thread pool) and an async one (runs on the event loop), on
   uvloop + httptools and on asyncio + h11. The body is a small JSON document validated by
   pydantic, like a protocol call's.
2. `--coordinator`: the real `coordinator serve` (one worker, a throwaway Postgres, no Kafka
   control plane), driven by two-partition begin + commit cycles, one sink per client. The
   server's CPU is split by thread from /proc/<pid>/task: the event loop's thread is the HTTP
   layer (uvicorn, the ASGI middlewares, routing, auth, validation, serialisation) and, while
   fewer calls run at once than half the database pool, the service's SQL too (the fast lane runs
   them on the loop); the other threads are the fast lane's pool (calls beyond that) and the
   recovery loop.

    python bench/http_overhead.py                  # 4 variants x 2 routes, ~1 min
    python bench/http_overhead.py --seconds 3 --clients 4
    python bench/http_overhead.py --coordinator --seconds 10 --clients 8

Last lines: one `key=value` line per variant, e.g.
    http uvloop sync cpu_us_per_call=… calls_per_s=… p99_ms=…
    http coordinator loop_cpu_us_per_call=… threads_cpu_us_per_call=… cpu_us_per_call=… calls_per_s=… p99_ms=…
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

from measure import CLK_TCK, cpu_snapshot, figure_line, log, percentile, start_embedded_postgres  # noqa: E402
from protocol_clients import HttpSink, Record, Server, free_port, register_http  # noqa: E402

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


def thread_ticks(pid: int) -> tuple[int, int]:
    """(the main thread's CPU ticks, all other threads') of process `pid`: with uvicorn's one
    worker in the serving process, the main thread runs the event loop."""
    main = rest = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        if int(tid) == pid:
            main += ticks
        else:
            rest += ticks
    return main, rest


def run_coordinator(seconds: float, clients: int) -> dict[str, float]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="http-overhead-") as d:
        tmp = Path(d)
        pg, url = start_embedded_postgres(tmp, 100)
        server = None
        try:
            log("starting coordinator serve --workers 1")
            server = Server(url, 1, 20, "info", tmp / "server.log")
            names = [f"overhead-{i:03d}" for i in range(clients)]
            sinks = [HttpSink(server.base_url, s["name"], s["token"])
                     for s in register_http(server.base_url, server.admin_token, names)]
            latencies: list[list[float]] = [[] for _ in range(clients)]
            counting = threading.Event()
            end = [float("inf")]

            def client(i: int) -> None:
                sink, batch = sinks[i], 0
                generation = sink.start_generation(f"q-{i}", "r-1")
                while time.monotonic() < end[0]:
                    t0 = time.monotonic()
                    begun = sink.begin(batch, generation, 2)
                    t1 = time.monotonic()
                    winners = sorted(begun.pre_leases)
                    sink.commit(batch, begun.attempt, generation, winners, [Record(1000 + p, 10) for p, _ in winners])
                    t2 = time.monotonic()
                    if counting.is_set():
                        latencies[i] += [(t1 - t0) * 1000.0, (t2 - t1) * 1000.0]
                    batch += 1

            log(f"coordinator: {clients} clients, begin + commit of 2 partitions, {seconds:.0f} s after 3 s warm-up")
            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            time.sleep(3)
            pid = server.proc.pid  # `coordinator serve` runs uvicorn's single worker in process
            (m0, r0), t0 = thread_ticks(pid), time.monotonic()
            counting.set()
            time.sleep(seconds)
            counting.clear()
            (m1, r1), wall = thread_ticks(pid), time.monotonic() - t0
            end[0] = 0.0
            for t in threads:
                t.join()
            for s in sinks:
                s.close()
        finally:
            if server is not None:
                server.stop()
            pg.cleanup()
    calls = sum(len(x) for x in latencies)
    loop_us, threads_us = 1e6 * (m1 - m0) / CLK_TCK / calls, 1e6 * (r1 - r0) / CLK_TCK / calls
    return {"loop_cpu_us_per_call": loop_us, "threads_cpu_us_per_call": threads_us,
            "cpu_us_per_call": loop_us + threads_us, "calls_per_s": calls / wall,
            "p99_ms": percentile([x for xs in latencies for x in xs], 99) or 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5, help="seconds per variant (default 5)")
    ap.add_argument("--clients", type=int, default=4, help="client threads, keep-alive each (default 4)")
    ap.add_argument("--coordinator", action="store_true",
                    help="measure the real coordinator (begin + commit cycles) instead of the bare stacks")
    args = ap.parse_args(argv)
    import tempfile

    if args.coordinator:
        line = figure_line("http coordinator", **run_coordinator(args.seconds, args.clients))
        print(f"\nhttp_overhead: {os.cpu_count()} CPUs (shared), coordinator serve with one worker; "
              "server CPU per call by thread from /proc (loop = the HTTP layer)")
        print(line)
        return 0

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
