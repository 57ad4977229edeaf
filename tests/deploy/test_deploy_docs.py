"""docs/deployment.md matches the files: every path it names exists, every command
names real files, kustomizations, Kubernetes objects and Secret keys, every setting it names is a
Settings field, and its figures (replica bounds, record counts, Kafka settings) are the files'."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import yaml
from fixtures.deploy_config import REPO_ROOT, compose_env, kustomize, load_compose, one, settings_env_names

from e2e.checker import Record, check, expected_range
from e2e.verify_output import build_parser

README = (REPO_ROOT / "README.md").read_text()


def section() -> str:
    return (REPO_ROOT / "docs" / "deployment.md").read_text()


def commands(text: str) -> list[list[str]]:
    """The commands of the section's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line:
                out.append(shlex.split(line))
    return out


@pytest.fixture(scope="module")
def overlay() -> list[dict[str, Any]]:
    return kustomize("deploy/k8s/overlays/example")


def test_the_first_two_commands_of_the_readme_are_unchanged() -> None:
    first = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first and first.group(1) == ("pip install -e '.[server]' && coordinator serve\n"
                                        "pip install -e '.[test]' && python -m pytest -ra\n")


def test_every_path_the_section_names_exists() -> None:
    paths = [p for p in re.findall(r"`([^`\s]+)`", section())
             if re.match(r"^(deploy/|e2e/|tests/|\.github/|Dockerfile$|docker-compose)", p)]
    assert len(paths) >= 12, paths
    missing = [p for p in paths if not (REPO_ROOT / p.rstrip("/")).exists()]
    assert not missing, missing


def test_every_command_names_real_files_and_objects(overlay: list[dict[str, Any]]) -> None:
    cmds = commands(section())
    assert cmds, "no commands"
    namespace = one(overlay, "Deployment")["metadata"]["namespace"]
    secret_keys = {e["valueFrom"]["secretKeyRef"]["key"]
                   for kind in ("Deployment", "Job")
                   for c in one(overlay, kind)["spec"]["template"]["spec"]["containers"]
                   for e in c.get("env", []) if "valueFrom" in e}
    seen_secret = False
    for cmd in cmds:
        env_prefix = [c for c in cmd if re.fullmatch(r"[A-Z_]+=\S*", c)]
        cmd = cmd[len(env_prefix):]
        for flag in ("-f", "-k"):
            for i, part in enumerate(cmd[:-1]):
                if part == flag and cmd[0] in ("docker", "kubectl"):
                    assert (REPO_ROOT / cmd[i + 1]).exists(), (cmd, cmd[i + 1])
        if cmd[0] == "kubectl":
            if "-n" in cmd:
                assert cmd[cmd.index("-n") + 1] == namespace, cmd
            if cmd[1:3] == ["create", "namespace"]:
                assert cmd[3] == namespace
            if cmd[3:5] == ["delete", "job"]:
                one(overlay, "Job", cmd[5])
            for ref in [c for c in cmd if re.fullmatch(r"(job|deployment)/[a-z-]+", c)]:
                kind, name = ref.split("/")
                one(overlay, {"job": "Job", "deployment": "Deployment"}[kind], name)
            if "secret" in cmd:
                seen_secret = True
                name = cmd[cmd.index("generic") + 1]
                refs = {e["valueFrom"]["secretKeyRef"]["name"] for c in one(overlay, "Deployment")["spec"]["template"]["spec"]["containers"]
                        for e in c["env"]}
                assert refs == {name}
                keys = {c.split("=", 2)[1] for c in cmd if c.startswith("--from-literal=")}
                assert keys == secret_keys, (keys, secret_keys)
        if cmd[:3] == ["python", "-m", "pytest"]:
            assert all((REPO_ROOT / c).exists() for c in cmd if c.startswith("tests/")), cmd
            assert "-m" in cmd[3:] and "e2e" in cmd
        if cmd[:3] == ["python", "-m", "e2e.verify_output"]:
            args = build_parser().parse_args(cmd[3:])
            e2e = load_compose("docker-compose.yml", "docker-compose.e2e.yml")["services"]["spark-job"]
            assert args.total_records == int(compose_env(e2e)["TOTAL_RECORDS"])
        if cmd[:3] == ["docker", "compose", "run"]:
            assert cmd[-1] in load_compose("docker-compose.yml")["services"]
    assert seen_secret


def test_every_setting_named_is_a_settings_field() -> None:
    named = set(re.findall(r"COORDINATOR_[A-Z_]+", section()))
    assert "COORDINATOR_MIGRATE_ON_START" in named
    assert named <= settings_env_names(), sorted(named - settings_env_names())


def test_the_figures_are_the_files(overlay: list[dict[str, Any]]) -> None:
    text = " ".join(section().split())
    base_hpa = yaml.safe_load((REPO_ROOT / "deploy/k8s/base/horizontalpodautoscaler.yaml").read_text())["spec"]
    hpa = one(overlay, "HorizontalPodAutoscaler")["spec"]
    assert f"between {base_hpa['minReplicas']} and {base_hpa['maxReplicas']} replicas" in text
    assert f"({hpa['minReplicas']} and {hpa['maxReplicas']} in the example overlay)" in text
    assert f"({base_hpa['metrics'][0]['resource']['target']['averageUtilization']} %)" in text
    services = load_compose("docker-compose.yml")["services"]
    job = compose_env(services["spark-job"])
    total = int(job["TOTAL_RECORDS"])
    assert f"`TOTAL_RECORDS` (default {total})" in text
    values = [str(i).encode() for i in range(total)]
    passing = check([Record("t", 0, i, v, v) for i, v in enumerate(values)], expected_range(total)).report()
    assert passing.splitlines()[0] in text  # the verifier's own first line
    assert f'`"0"`..`"{total - 1}"`' in text
    assert f"prefix `{job['TRANSACTIONAL_ID_PREFIX']}`" in text
    kafka = compose_env(services["kafka"])
    assert f"`transaction.max.timeout.ms` {kafka['KAFKA_TRANSACTION_MAX_TIMEOUT_MS']}" in text
    assert f"`TRANSACTION_TIMEOUT_MS`, {job['TRANSACTION_TIMEOUT_MS']}" in text
    assert f"Apache Kafka {services['kafka']['image'].split(':')[1].rsplit('.', 1)[0]} in KRaft mode" in text
    e2e = compose_env(load_compose("docker-compose.yml", "docker-compose.e2e.yml")["services"]["spark-job"])
    assert f"for {e2e['TOTAL_RECORDS']} rows" in text and f"`SPARK_MASTER={e2e['SPARK_MASTER']}`" in text
    config = (REPO_ROOT / "deploy/k8s/base/coordinator.env").read_text()
    pool = int(re.search(r"^COORDINATOR_DB_POOL_SIZE=(\d+)$", config, re.M).group(1))  # type: ignore[union-attr]
    assert f"({pool} in the ConfigMap)" in text and f"replicas × workers × {2 * pool}" in text
