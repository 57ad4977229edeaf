"""What the image builds take from the host instead of downloading inside a container: the Python
wheels of the project's dependencies (`pip wheel` here, into deploy/image-inputs/wheels/), Spark's
Kafka connector and Kafka's own jars (Maven here, from the poms in localkafka/poms/)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from .podman import REPO_ROOT

INPUTS = REPO_ROOT / "deploy" / "image-inputs"
WHEELS = INPUTS / "wheels"
SPARK_JARS = INPUTS / "spark-jars"
EXTRAS = "server,spark"  # what the coordinator image ([server]) and the job image ([spark,server]) install
PROJECT_WHEEL = "spark_kafka_exactly_once-"  # the images build the project's own wheel themselves


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _wheels_key() -> str:
    meta = _pyproject()
    facts = repr((meta["build-system"]["requires"], meta["project"]["dependencies"],
                  [meta["project"]["optional-dependencies"][e] for e in EXTRAS.split(",")], sys.version_info[:2]))
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


def ensure_wheels() -> bool:
    """Wheels of every pinned dependency of [server,spark] and of the build backend, built on the
    host; False when the ones there already match pyproject.toml."""
    stamp = WHEELS / ".pyproject-key"
    key = _wheels_key()
    if stamp.is_file() and stamp.read_text() == key:
        return False
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--wheel-dir", str(WHEELS),
           f".[{EXTRAS}]", *_pyproject()["build-system"]["requires"]]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"pip wheel failed:\n{(done.stdout + done.stderr)[-3000:]}")
    for own in WHEELS.glob(PROJECT_WHEEL + "*.whl"):
        own.unlink()
    stamp.write_text(key)
    return True


def ensure_spark_jars() -> bool:
    """Spark's Kafka connector for the pinned pyspark (resolved by Maven into ~/.m2) in
    deploy/image-inputs/spark-jars/; False when they are there already."""
    from localkafka.maven import spark_kafka_jars

    pyspark_pin = next(d for d in _pyproject()["project"]["optional-dependencies"]["spark"] if d.startswith("pyspark=="))
    jars = [Path(j) for j in spark_kafka_jars(pyspark_pin.split("==")[1])]
    return link_files(jars, SPARK_JARS)


def kafka_jars(version: str) -> list[Path]:
    """Kafka's server and tools at `version` (Maven, ~/.m2)."""
    from localkafka.maven import kafka_image_classpath

    return [Path(j) for j in kafka_image_classpath(version)]


def link_files(files: list[Path], directory: Path) -> bool:
    """Make `directory` hold exactly `files` (hard links where the filesystem allows, else copies);
    False when it already did."""
    wanted = {f.name: f for f in files}
    if directory.is_dir() and {p.name for p in directory.iterdir()} == set(wanted) and all(
            (directory / n).stat().st_size == f.stat().st_size for n, f in wanted.items()):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for name, src in wanted.items():
        try:
            os.link(src, directory / name)
        except OSError:
            shutil.copy2(src, directory / name)
    return True


def tree_hash(paths: list[Path], root: Path = REPO_ROOT) -> str:
    """A hash of every file under `paths` (names relative to root, and contents); caches and
    compiled files left out."""
    h = hashlib.sha256()
    for top in paths:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            h.update(str(f.relative_to(root)).encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]
