"""The protocol benchmark's load: driver threads (one sink each) running checkpoint cycles back to
back, their executors' calls in a thread pool per driver, spread over spawned load processes
(each its own GIL, like uvicorn workers); one measurement window over all of them, and a check of
the record afterwards."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import threading
import time
import traceback
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from measure import (
    SqlCounter, WaitSampler, cpu_delta, cpu_snapshot, log, percentile, pg_counters, plain_url, table_writes,
    table_writes_per,
)
from protocol_clients import Begun, HttpSink, InprocessSink, Record, Rejected

# the protocol's calls, then what else a batch's timeline holds: a task's Kafka transaction (kafka
# mode) and the whole batch
CALLS = ("begin", "lease", "commit")
TIMINGS = (*CALLS, "task_txn", "cycle")
FIRST_OFFSETS = 4  # first offsets a task's record names (the writer's FIRST_OFFSETS_REPORTED)
CLASSIC, SAME_CALLS = "classic", "same-calls"  # the batch's path (see _run_driver)


class Stats:
    """Latency samples of calls that started inside the measurement window, cycles that finished
    inside it, and errors. list.append is atomic under the GIL, so threads share one Stats."""

    def __init__(self, t_start: float, t_end: float) -> None:
        self.t_start, self.t_end = t_start, t_end
        self.samples: dict[str, list[float]] = {k: [] for k in TIMINGS}
        self.cycles = 0
        self.calls = 0  # protocol calls of the cycles counted in `cycles`
        self.cycles_total = 0
        self.late = 0  # paced: window cycles that started over one interval behind their schedule
        self.first_cycles: list[float] = []
        self.errors: Counter[str] = Counter()
        self.error_examples: list[str] = []
        self.lock = threading.Lock()

    def record(self, call: str, t0: float, t1: float) -> None:
        if self.t_start <= t0 < self.t_end:
            self.samples[call].append((t1 - t0) * 1000.0)

    def error(self, exc: BaseException) -> None:
        key = exc.reason if isinstance(exc, Rejected) else getattr(exc, "reason", type(exc).__name__)
        with self.lock:
            self.errors[key] += 1
            if len(self.error_examples) < 5:
                self.error_examples.append("".join(traceback.format_exception_only(type(exc), exc)).strip()[:500])


def _run_driver(sink: Any, generation: int, partitions: int, executors: ThreadPoolExecutor, stats: Stats,
                progress: Any, driver_no: int, primed: threading.Barrier, started: threading.Event,
                topic_partitions: int, pace: tuple[float, float] | None, path: str, txns: Any,
                first_batch: int = 0) -> None:
    """One driver: a first, unmeasured cycle (it grows the sink's transactional id pool from
    empty, which is not the steady state), then cycles until the window ends: back to back, or
    with `pace` (interval, offset in seconds) each starting on a schedule of one per interval from
    the start plus offset. A driver behind its schedule starts its next cycle at once, until it has
    caught up: the load asked of the service does not shrink when the service slows down.

    A batch on the `classic` path is what the writer does: begin with the partition count (one id
    pre-leased per partition), then each partition's task try asks for its lease (the first claims
    the pre-lease) unless begin named it (the code before the rebuild: first tries made no call),
    then commit with every winner's record. On the `same-calls` path begin takes no partition
    count and every try's lease call takes a fresh id (what both codes do alike). With `txns` (a
    kafka_transactions.TransactionPool) each task opens a real Kafka transaction on its id."""
    clock = time.monotonic
    batch_id = first_batch  # a sink driven again in a later run goes on after its earlier batches
    task_attempt_id = driver_no * 10**12
    claims = sink.claims

    def task(batch: int, attempt: int, partition: int, task_id: int, named: tuple[int, str] | None) -> tuple:
        t0 = clock()
        if named is None:
            lease_id, tid = sink.lease(batch, attempt, generation, partition, task_id)
            stats.record("lease", t0, clock())
        else:
            lease_id, tid = named
        if txns is None:
            offsets = [["bench", k, 10 * batch] for k in range(min(topic_partitions, FIRST_OFFSETS))] \
                if topic_partitions else None
            record = Record(task_id, 1000 + partition, 0, 10, 5, offsets)
        else:
            t1 = clock()
            producer_id, epoch, offsets = txns.open(tid, partition)
            stats.record("task_txn", t1, clock())
            record = Record(task_id, producer_id, epoch, txns.records_per_task, int((clock() - t1) * 1000), offsets)
        return partition, lease_id, tid, record

    def cycle() -> tuple[float, float, int, list[str]]:
        nonlocal task_attempt_id
        c0 = clock()
        begun: Begun = sink.begin(batch_id, generation, partitions if path == CLASSIC else None)
        c1 = clock()
        stats.record("begin", c0, c1)
        if begun.attempt is None:
            raise RuntimeError(f"batch {batch_id} unexpectedly already committed")
        if path == CLASSIC and begun.pre_leased != partitions:
            raise RuntimeError(f"begin pre-leased {begun.pre_leased} ids, expected {partitions}")
        named = {p: (lid, tid) for p, lid, tid in begun.pre_leases} if path == CLASSIC and not claims else {}
        calls = 2 + (partitions - len(named))
        if txns is None and len(named) == partitions:  # nothing for the tasks to do: no thread hand-off
            done = [task(batch_id, begun.attempt, p, 0, named[p]) for p in range(partitions)]
        else:
            futures = []
            for p in range(partitions):
                task_attempt_id += 1
                futures.append(executors.submit(task, batch_id, begun.attempt, p, task_attempt_id, named.get(p)))
            done = [f.result() for f in futures]
        c2 = clock()
        committed = sink.commit(batch_id, begun.attempt, generation, [(p, lid) for p, lid, _, _ in done],
                                [r for _, _, _, r in done])
        c3 = clock()
        stats.record("commit", c2, c3)
        if committed != partitions:
            raise RuntimeError(f"commit named {committed} winners, expected {partitions}")
        stats.record("cycle", c0, c3)
        return c0, c3, calls, [tid for _, _, tid, _ in done]

    def after(tids: list[str]) -> None:
        """Kafka mode: ready each id's producer for its next transaction, unless the run is over
        (the last batch's transactions are left to the coordinator's commit alone)."""
        if txns is not None and clock() < stats.t_end:
            list(executors.map(lambda t: txns.finished([t]), tids))

    try:
        c0, c3, _, tids = cycle()
        after(tids)
        with stats.lock:
            stats.first_cycles.append((c3 - c0) * 1000.0)
    except Exception as exc:  # noqa: BLE001
        stats.error(exc)
    batch_id += 1
    primed.wait()
    started.wait()
    scheduled = clock() + pace[1] if pace else 0.0
    while clock() < stats.t_end:
        if pace:
            ahead = scheduled - clock()
            if ahead > 0:
                time.sleep(ahead)
            elif -ahead > pace[0] and stats.t_start <= clock() < stats.t_end:
                with stats.lock:
                    stats.late += 1
            scheduled += pace[0]
        try:
            _, c3, calls, tids = cycle()
            with stats.lock:  # drivers of this process share stats
                stats.cycles_total += 1
                if stats.t_start <= c3 < stats.t_end:
                    stats.cycles += 1
                    stats.calls += calls
            if stats.t_start <= c3 < stats.t_end:
                with progress.get_lock():
                    progress.value += 1
            after(tids)
        except Exception as exc:  # noqa: BLE001 - a benchmark counts failures and goes on
            stats.error(exc)
            time.sleep(0.01)
        batch_id += 1


def load_process(job: dict[str, Any], window: Any, ready: Any, go: Any, progress: Any, results: Any) -> None:
    """Entry point of one load process: builds its clients, starts its drivers' generations,
    reports ready, waits for go, runs until the window ends, sends back its samples."""
    try:
        warnings.simplefilter("ignore")
        engine = counter = None
        if job["mode"] == "inprocess":
            from coordinator.kafka.control_plane import RecordingControlPlane
            from coordinator.service import Coordinator
            from coordinator.store.db import make_engine

            engine = make_engine(job["url"], pool_size=job["pool_size"])
            counter = SqlCounter(engine)
            coordinator = Coordinator(engine, RecordingControlPlane(keep_history=False))
            sinks: list[Any] = [InprocessSink(coordinator, s["name"]) for s in job["sinks"]]
        else:
            sinks = [HttpSink(job["base_url"], s["name"], s["token"]) for s in job["sinks"]]
        txns = None
        if job.get("kafka"):
            from kafka_transactions import TransactionPool

            k = job["kafka"]
            txns = TransactionPool(k["bootstrap"], k["topic"], k["topic_partitions"], k["records_per_task"])
        generations = [s.start_generation(f"query-{s.name}", f"run-{s.name}-{secrets.token_hex(4)}") for s in sinks]

        stats = Stats(float("inf"), float("inf"))  # records nothing until the window is known
        started = threading.Event()
        primed = threading.Barrier(len(sinks) + 1, timeout=600)
        pools = [ThreadPoolExecutor(max_workers=job["partitions"], thread_name_prefix=f"exec{i}") for i in range(len(sinks))]
        rate, drivers = job.get("rate"), job.get("drivers", len(sinks))

        def pace(driver_no: int) -> tuple[float, float] | None:
            """Each driver's share of the run's rate, the drivers' schedules spread over one interval."""
            if not rate:
                return None
            interval = drivers / rate
            return interval, interval * driver_no / drivers

        threads = [
            threading.Thread(target=_run_driver, args=(
                s, gen, job["partitions"], pool, stats, progress, job["first_driver"] + i, primed, started,
                job["topic_partitions"], pace(job["first_driver"] + i), job.get("path", CLASSIC), txns,
                job.get("first_batch", 0)))
            for i, (s, gen, pool) in enumerate(zip(sinks, generations, pools))
        ]
        for t in threads:
            t.start()
        primed.wait()  # every driver has done its first cycle
        # as `coordinator serve` does once its app is built: full collections skip what exists now
        # (modules, engine, pools), and start rarely
        from coordinator.app import settle_gc
        settle_gc()
        ready.put(os.getpid())
        go.wait()
        stats.t_start, stats.t_end = window[0], window[1]
        if counter is not None:
            counter.reset()
        started.set()
        for t in threads:
            t.join()
        for p in pools:
            p.shutdown(wait=True)
        for s in sinks:
            if isinstance(s, HttpSink):
                s.close()
        if txns is not None:
            txns.close()
        results.put({
            "pid": os.getpid(),
            "samples": stats.samples,
            "cycles": stats.cycles,
            "calls": stats.calls,
            "cycles_total": stats.cycles_total,
            "late": stats.late,
            "first_cycles": stats.first_cycles,
            "errors": dict(stats.errors),
            "error_examples": stats.error_examples,
            "statements": counter.statements if counter else None,
            "checkouts": counter.checkouts if counter else None,
            "round_trips": counter.round_trips() if counter else None,
            "transactions": txns.opened if txns else 0,
        })
        if engine is not None:
            engine.dispose()
    except BaseException:  # noqa: BLE001 - report, never hang the parent
        results.put({"pid": os.getpid(), "fatal": traceback.format_exc()})
        try:
            ready.put(os.getpid())
        except Exception:  # noqa: BLE001
            pass


def split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def run_load(label: str, jobs: list[dict[str, Any]], *, seconds: float, warmup: float, progress_every: float,
             url: str, server_pid: int | None, postgres_pid: int | None,
             broker_pid: int | None = None) -> dict[str, Any]:
    """Start the load processes, wait until each has primed its drivers, then measure one window:
    batches, calls and latencies from the drivers, CPU per party from /proc, Postgres transactions
    from pg_stat_database, sessions' states from pg_stat_activity."""
    ctx = mp.get_context("spawn")
    window = ctx.Array("d", 2, lock=False)
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    progress = ctx.Value("q", 0)
    procs = [ctx.Process(target=load_process, args=(j, window, ready, go, progress, results), daemon=True) for j in jobs]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    now = time.monotonic()
    window[0] = now + warmup
    window[1] = now + warmup + seconds
    go.set()
    time.sleep(max(0.0, window[0] - time.monotonic()))
    writes0 = table_writes(url)
    cpu0, (c0, r0, n0), w0 = cpu_snapshot(server_pid, postgres_pid, broker_pid), pg_counters(url), time.monotonic()
    sampler = WaitSampler(url)
    sampler.start()
    last_n, last_t = progress.value, w0
    while True:
        left = window[1] - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(progress_every, left))
        n, t = progress.value, time.monotonic()
        log(f"  {label}: {t - w0:5.1f}s  {n:8d} batches  {(n - last_n) / (t - last_t):9.1f} batches/s now")
        last_n, last_t = n, t
    cpu1, w1 = cpu_snapshot(server_pid, postgres_pid, broker_pid), time.monotonic()
    waits = sampler.stop()
    own_xacts = sampler.samples + 1
    time.sleep(1.1)  # let backends flush their transaction counters
    c1, r1, n1 = pg_counters(url)
    writes1 = table_writes(url)
    outs = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    fatal = [o["fatal"] for o in outs if "fatal" in o]
    if fatal:
        raise RuntimeError(f"{label}: a load process failed:\n" + "\n".join(fatal))
    samples: dict[str, list[float]] = {}
    errors: Counter[str] = Counter()
    examples: list[str] = []
    for o in outs:
        for k, v in o["samples"].items():
            samples.setdefault(k, []).extend(v)
        errors.update(o["errors"])
        examples.extend(o["error_examples"])
    done = sum(o["cycles"] for o in outs)
    total = sum(o["cycles_total"] for o in outs)
    counted = [o for o in outs if o["statements"] is not None]
    return {
        "label": label,
        "seconds": seconds,
        "rate": done / seconds,
        "completed": done,
        "calls_per_batch": sum(o["calls"] for o in outs) / done if done else None,
        "latency_ms": {
            k: {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99)} for k, v in samples.items() if v
        },
        "errors": dict(errors),
        "transactions": sum(o["transactions"] for o in outs),
        "error_examples": examples[:5],
        "cycles_total": total,
        "late_cycles": sum(o["late"] for o in outs),
        "first_cycle_ms": sorted(x for o in outs for x in o["first_cycles"]),
        "statements_per_batch": sum(o["statements"] for o in counted) / total if counted and total else None,
        "checkouts_per_batch": sum(o["checkouts"] for o in counted) / total if counted and total else None,
        "round_trips_per_batch": sum(o["round_trips"] for o in counted) / total if counted and total else None,
        # less the benchmark's own: the sampler's queries and the first counter query (each one
        # transaction; ~20/s, a sixth of a 200-partition run's figure)
        "db_xacts_per_s": (c1 - c0 + r1 - r0 - own_xacts) / (w1 - w0),
        "db_commits_per_s": (c1 - c0 - own_xacts) / (w1 - w0),
        "db_sessions_opened_per_s": max(0, n1 - n0 - 2) / (w1 - w0),  # less the sampler and counter query
        "cpu": cpu_delta(cpu0, cpu1, w1 - w0),
        "db_sessions": waits,
        # the window's batches plus each driver's last one, finished after the window closed
        "row_writes_per_batch": table_writes_per(
            writes0, writes1, done + sum(len(o["first_cycles"]) for o in outs)) if done else "",
    }


def check_record(url: str, names: list[str], cycles_total: int) -> dict[str, Any]:
    """After a run: every cycle a driver saw complete is a COMMITTED checkpoint, nothing is left
    open, and the size of each sink's transactional id pool."""
    import psycopg

    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        committed, open_attempts, unresolved = conn.execute(
            "SELECT (SELECT count(*) FROM checkpoints c WHERE c.sink_id = ANY(ids) AND c.state = 'COMMITTED'),"
            "       (SELECT count(*) FROM attempts a WHERE a.sink_id = ANY(ids) AND a.state <> 'COMMITTED'),"
            "       (SELECT count(*) FROM leases l WHERE l.sink_id = ANY(ids) AND l.state <> 'COMMITTED')"
            "  FROM (SELECT array_agg(id) AS ids FROM sinks WHERE name = ANY(%s)) s",
            (names,),
        ).fetchone()
        rebuilt = conn.execute("SELECT to_regclass('id_pools') IS NOT NULL").fetchone()[0]
        pools = [n for (n,) in conn.execute(
            "SELECT coalesce(p.size, 0) FROM sinks s LEFT JOIN id_pools p ON p.sink_id = s.id WHERE s.name = ANY(%s)"
            if rebuilt else  # the code before the rebuild: a row per id
            "SELECT count(t.id) FROM sinks s LEFT JOIN transactional_ids t ON t.sink_id = s.id "
            "WHERE s.name = ANY(%s) GROUP BY s.id", (names,)
        ).fetchall()]
    return {
        "committed_checkpoints": committed,
        "cycles_completed_by_drivers": cycles_total,
        "attempts_not_committed": open_attempts,
        "leases_not_committed": unresolved,
        "pool_size_min": min(pools) if pools else 0,
        "pool_size_max": max(pools) if pools else 0,
    }
