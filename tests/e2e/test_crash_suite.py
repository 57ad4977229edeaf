"""The crash suite (`python -m e2e.crash_suite`, issue 11) on a real 3-node Kafka cluster, in the e2e
tier (CI's own step, `.ci/run`; `python -m pytest -m e2e tests/e2e/test_crash_suite.py`): one
seed must end with the exactly-once line and exit 0; a run whose output was broken on purpose
(`--break duplicate`: one extra copy of a record written before verification) must fail the
verdict. The verdict line itself is checked without Kafka on hand-made records."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.servers import REPO_ROOT, clean_env

from e2e.checker import Record, check, expected_range
from e2e.crash_suite import verdict_line

LINE = re.compile(r"^exactly-once: in=(\d+) out=(\d+) duplicates=(\d+) missing=(\d+) open_transactions=(\d+) "
                  r"kills=(\d+)$")


def suite(tmp_path: Path, *args: str, timeout: float = 900) -> tuple[int, str, re.Match[str]]:
    out = subprocess.run([sys.executable, "-m", "e2e.crash_suite", "--dir", str(tmp_path / "suite"), *args],
                         cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    text = out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    m = LINE.match(last)
    assert m, f"no verdict line at the end:\n{text[-6000:]}"
    return out.returncode, text, m


def records(values: list[str]) -> list[Record]:
    return [Record("out", 0, i, v.encode(), v.encode()) for i, v in enumerate(values)]


def test_the_verdict_line_counts_and_passes_only_when_everything_holds() -> None:
    good = check(records(["0", "1", "2"]), expected_range(3), [], prefix="p-", key_equals_value=True)
    assert verdict_line(good, 3, 6) == (
        "exactly-once: in=3 out=3 duplicates=0 missing=0 open_transactions=0 kills=6", True)
    dup = check(records(["0", "1", "2", "1", "1"]), expected_range(3), [], prefix="p-", key_equals_value=True)
    assert verdict_line(dup, 3, 0) == (
        "exactly-once: in=3 out=5 duplicates=2 missing=0 open_transactions=0 kills=0", False)
    lost = check(records(["0", "2"]), expected_range(3), [], prefix="p-", key_equals_value=True)
    assert verdict_line(lost, 3, 1) == (
        "exactly-once: in=3 out=2 duplicates=0 missing=1 open_transactions=0 kills=1", False)
    unstable = check(records(["0", "1", "2"]), expected_range(3), [], prefix="p-", key_equals_value=True,
                     unstable_partitions=["out[0] last stable offset 1 < high watermark 3"])
    assert verdict_line(unstable, 3, 1)[1] is False  # the line's counts hold, the LSO does not


@pytest.mark.e2e
@pytest.mark.real_kafka
@pytest.mark.timeout(900)  # a 3-node cluster, Postgres, two replicas, a Spark job restarted after its kills
def test_one_seed_survives_every_kill_exactly_once(tmp_path: Path) -> None:
    code, text, m = suite(tmp_path, "--seed", "1", "--records", "240")
    assert code == 0, text[-6000:]
    n_in, n_out, dups, missing, open_txns, kills = map(int, m.groups())
    assert (n_in, n_out, dups, missing, open_txns) == (240, 240, 0, 0, 0), text[-6000:]
    assert kills >= 5, text[-6000:]
    for what in ("SIGKILL the Spark driver", "SIGKILL a Python worker", "SIGKILL coordinator replica",
                 "SIGKILL Postgres", "SIGKILL Kafka broker", "__transaction_state partitions"):
        assert what in text, f"no {what!r} in the run:\n{text[-6000:]}"


@pytest.mark.e2e
@pytest.mark.real_kafka
@pytest.mark.timeout(600)
def test_a_duplicate_in_the_output_fails_the_verdict(tmp_path: Path) -> None:
    code, text, m = suite(tmp_path, "--seed", "2", "--records", "60", "--no-kills", "--break", "duplicate")
    assert code == 1, text[-6000:]
    assert m.group(0) == "exactly-once: in=60 out=61 duplicates=1 missing=0 open_transactions=0 kills=0", text
    assert "duplicated (1 values)" in text and "'0' x2" in text, text[-6000:]
