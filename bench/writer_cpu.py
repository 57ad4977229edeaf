"""CPU seconds by party for the writer benchmark, from /proc: every process of a party counts, with
the CPU of its children that exited and were reaped (cutime + cstime), so a Python worker that
exits between two samples still counts (it moves into its parent's cutime), and a worker that
lives and dies between them counts too. Sampling only PySpark's daemon (its own utime) would miss
every worker it forked.

Parties, by process tree: `driver` (this process: the Python driver, foreachBatch's driver code),
`spark_jvm` (the Spark JVM itself), `python_workers` (everything the Spark JVM started: PySpark's
daemons, their forked workers, the data source's planner and commit processes), `broker` (the
Kafka JVM), `coordinator` (`coordinator serve` and its children), `postgres` (the embedded
Postgres), `other` (any other child of this process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PARTIES = ("driver", "spark_jvm", "python_workers", "broker", "coordinator", "postgres", "other")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    ticks: int  # utime + stime + cutime + cstime
    own_ticks: int  # utime + stime
    cmdline: str


def proc_table() -> dict[int, Proc]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
            cmdline = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2:].split()
        utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
        out[int(d)] = Proc(int(d), int(rest[1]), utime + stime + cutime + cstime, utime + stime, cmdline)
    return out


def descendants(table: dict[int, Proc], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, []))
    return seen


def classify(table: dict[int, Proc], me: int, coordinator_pid: int | None, postgres_pid: int | None) -> dict[int, str]:
    """pid -> party, for this process's tree, the coordinator's and Postgres's."""
    party: dict[int, str] = {}
    for root, name in ((postgres_pid, "postgres"), (coordinator_pid, "coordinator")):
        if root:
            for pid in descendants(table, root):
                party.setdefault(pid, name)
    mine = descendants(table, me)
    for pid in mine:
        p = table[pid]
        if pid in party:
            continue
        if "kafka.Kafka" in p.cmdline:
            for sub in descendants(table, pid):
                party[sub] = "broker"
        elif "org.apache.spark.deploy.SparkSubmit" in p.cmdline:
            party[pid] = "spark_jvm"
            for sub in descendants(table, pid) - {pid}:
                party[sub] = "python_workers"
    for pid in mine:
        party.setdefault(pid, "driver" if pid == me else "other")
    return party


def snapshot(coordinator_pid: int | None = None, postgres_pid: int | None = None, *, own_only: bool = False,
             me: int | None = None) -> dict[str, float]:
    """CPU ticks so far by party. `own_only` leaves out reaped children (the broken variant the
    tests show undercounting exited workers)."""
    table = proc_table()
    totals = dict.fromkeys(PARTIES, 0.0)
    for pid, name in classify(table, me or os.getpid(), coordinator_pid, postgres_pid).items():
        p = table.get(pid)
        if p is not None:
            totals[name] += p.own_ticks if own_only else p.ticks
    return totals


def seconds_between(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """CPU seconds each party used between two snapshots."""
    return {k: (b[k] - a[k]) / CLK_TCK for k in PARTIES}
