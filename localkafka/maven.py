"""JVM artifacts through Maven: the poms in localkafka/poms/ are resolved with
`mvn dependency:build-classpath`, so the jars stay in Maven's own cache (~/.m2) and nothing is
downloaded by hand-written code. The resolved classpath is remembered per version in
~/.cache/spark-kafka-eos/ so that later starts need neither Maven nor the network."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

# Newest first: the default Kafka version is the first of these that resolves.
KAFKA_VERSIONS = ("4.4.0", "4.3.1", "4.2.0", "4.1.1", "4.0.1")
# what was resolved through Maven in this process, and how long it took (seconds): the tests'
# summary reports it, so a CI log shows the first resolution's cost
RESOLVED: dict[str, float] = {}
# pyspark version -> Spark's Kafka connector that resolves on Maven Central for it
SPARK_CONNECTORS = {"4.2": ("4.2.0", "2.13"), "4.1": ("4.1.1", "2.13"), "3.5": ("3.5.7", "2.12")}


class MavenError(RuntimeError):
    """Maven is missing, or could not resolve an artifact; the message says what to do."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("LOCALKAFKA_CACHE", Path(base) / "spark-kafka-eos"))


def _pom(name: str) -> str:
    return resources.files("localkafka").joinpath("poms", name).read_text()


def _build_classpath(pom: str, properties: dict[str, str], include: str | None, what: str) -> list[str]:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MavenError(
            f"{what} needs Maven to resolve its jars (and Java 17 to run them): install them "
            "(Debian: apt-get install -y maven openjdk-17-jre-headless), or copy a machine's "
            f"{cache_dir()} and ~/.m2 here")
    with tempfile.TemporaryDirectory(prefix="localkafka-mvn-") as tmp:
        Path(tmp, "pom.xml").write_text(pom)
        out = Path(tmp, "classpath.txt")
        cmd = [mvn, "-B", "-q", "-f", str(Path(tmp, "pom.xml")), "dependency:build-classpath",
               f"-Dmdep.outputFile={out}", *(f"-D{k}={v}" for k, v in properties.items())]
        if include:
            cmd.append(f"-DincludeArtifactIds={include}")
        print(f"localkafka: resolving {what} through Maven (first use on this machine; jars go to ~/.m2) ...",
              file=sys.stderr, flush=True)
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        RESOLVED[what] = time.monotonic() - started
        print(f"localkafka: Maven {'resolved' if done.returncode == 0 else 'FAILED to resolve'} {what} "
              f"in {RESOLVED[what]:.1f} s", file=sys.stderr, flush=True)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
            raise MavenError(f"Maven could not resolve {what} ({' '.join(f'{k}={v}' for k, v in properties.items())}):"
                             f"\n{tail}")
        jars = [p for p in out.read_text().strip().split(os.pathsep) if p]
    missing = [j for j in jars if not Path(j).is_file()]
    if not jars or missing:
        raise MavenError(f"Maven resolved {what} but jars are missing: {missing[:3] or 'none listed'}")
    return jars


def _cached(key: str, resolve: callable) -> list[str]:  # type: ignore[valid-type]
    path = cache_dir() / f"{key}.classpath"
    if path.exists():
        jars = path.read_text().split("\n")
        if jars and all(Path(j).is_file() for j in jars):
            return jars
    jars = resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(jars))
    tmp.replace(path)
    return jars


def kafka_classpath(version: str) -> list[str]:
    """The jars of Apache Kafka's server `version` (kafka_2.13 and its runtime dependencies)."""
    return _cached(f"kafka-{version}", lambda: _build_classpath(
        _pom("kafka-server.xml"), {"kafka.version": version}, None, f"Apache Kafka {version}"))


def kafka_image_classpath(version: str) -> list[str]:
    """The jars of the local stand-in for the apache/kafka image (localimages/): Kafka's server,
    its command-line tools (kafka-tools) and an slf4j binding, at `version`."""
    return _cached(f"kafka-image-{version}", lambda: _build_classpath(
        _pom("kafka-image.xml"), {"kafka.version": version}, None, f"Apache Kafka {version} server and tools"))


def default_kafka_version() -> str:
    """The newest Kafka 4.x of KAFKA_VERSIONS that resolves (remembered once found)."""
    remembered = cache_dir() / "kafka-default-version"
    if remembered.exists() and (cache_dir() / f"kafka-{remembered.read_text().strip()}.classpath").exists():
        return remembered.read_text().strip()
    errors = []
    for version in KAFKA_VERSIONS:
        try:
            kafka_classpath(version)
        except MavenError as exc:
            if "needs Maven" in str(exc):
                raise
            errors.append(f"{version}: {str(exc).splitlines()[0]}")
            continue
        remembered.parent.mkdir(parents=True, exist_ok=True)
        remembered.write_text(version)
        return version
    raise MavenError("no Kafka version resolved:\n" + "\n".join(errors))


def spark_kafka_jars(pyspark_version: str | None = None) -> list[str]:
    """Spark's Kafka connector for the installed pyspark (or `pyspark_version`): the connector,
    its token provider, kafka-clients and commons-pool2 (pyspark ships the rest), for spark.jars."""
    if pyspark_version is None:
        import pyspark

        pyspark_version = pyspark.__version__
    line = ".".join(pyspark_version.split(".")[:2])
    if line not in SPARK_CONNECTORS:
        raise MavenError(f"no Spark Kafka connector known to resolve for pyspark {pyspark_version} "
                         f"(known: {', '.join(sorted(SPARK_CONNECTORS))})")
    spark_version, scala = SPARK_CONNECTORS[line]
    include = ",".join([f"spark-sql-kafka-0-10_{scala}", f"spark-token-provider-kafka-0-10_{scala}",
                        "kafka-clients", "commons-pool2"])
    return _cached(f"spark-kafka-{spark_version}_{scala}", lambda: _build_classpath(
        _pom("spark-kafka.xml"), {"spark.version": spark_version, "scala.suffix": scala}, include,
        f"Spark's Kafka connector {spark_version} (Scala {scala})"))
