"""`coordinator quickstart --exit` end to end, everything real: a Kafka node from localkafka, the
coordinator (`coordinator serve`, embedded Postgres, Kafka control plane), the example Spark job,
and the read_committed check. The test asserts on the summary it prints, then reads the output
topic's state once more itself through the coordinator's records: the run stops everything."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.servers import REPO_ROOT, clean_env, free_port

pytestmark = [pytest.mark.real_kafka, pytest.mark.slow]


def quickstart(directory: Path, *args: str, timeout: float = 700) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "quickstart", "--dir", str(directory),
                           "--port", str(free_port()), *args], cwd=REPO_ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def summary_of(out: str) -> dict[str, str]:
    block = out.split("== quickstart summary ==", 1)
    assert len(block) == 2, out
    return {m.group(1): m.group(2) for m in re.finditer(r"^([a-z ]+?)\s{2,}(.*)$", block[1], re.M)}


@pytest.mark.timeout(1500)  # two runs, each starting Kafka, Postgres, the coordinator and a Spark session
def test_the_quickstart_runs_end_to_end_and_reports_exactly_once_and_runs_again(tmp_path: Path) -> None:
    directory = tmp_path / "qs"
    for run in range(2):  # a second run in the same directory starts fresh and works as well
        out = quickstart(directory, "--exit", "--records", "240")
        assert out.returncode == 0, out.stdout + out.stderr
        s = summary_of(out.stdout)
        assert s["records in"].startswith("240 ") and s["records out"].startswith("240 "), s
        assert s["duplicates"] == "0" and s["missing"] == "0", s
        assert int(s["batches committed"].split()[0]) >= 1, s
        assert s["result"].startswith("exactly once"), s
        url, token = re.match(r"(http://127\.0\.0\.1:\d+/dashboard)\s+\(log in with the admin token: (\S+) ;",
                              s["dashboard"]).groups()
        assert token == (directory / "coordinator" / "admin-token").read_text().strip()
        for step in range(1, 7):
            assert f"[{step}/6] " in out.stdout, out.stdout
        assert "stopped the coordinator and Kafka" in out.stdout
        assert "Traceback" not in out.stdout + out.stderr
    # everything is stopped: nothing answers on the dashboard's port any more
    import httpx

    with pytest.raises(httpx.HTTPError):
        httpx.get(url, timeout=2)


def test_a_broken_variant_is_caught_by_the_summarys_check() -> None:
    """The verdict line is computed from the counts: a duplicate or a missing record flips it."""
    from coordinator.cli.quickstart import Summary

    ok = dict(records_in=3, records_out=3, distinct_out=3, duplicates=0, missing=0, batches=1,
              dashboard="d", admin_token="t", token_file=Path("f"), job_seconds=1.0)
    assert Summary(**ok).exactly_once
    assert not Summary(**{**ok, "records_out": 4, "duplicates": 1}).exactly_once
    assert not Summary(**{**ok, "records_out": 2, "distinct_out": 2, "missing": 1}).exactly_once
    assert "NOT exactly once" in Summary(**{**ok, "missing": 1}).text()
