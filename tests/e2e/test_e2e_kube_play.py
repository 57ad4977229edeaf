"""The Kubernetes manifests' containers, run for real by `podman kube play` (`-m e2e`, Podman only):
deploy/k8s/base's migration Job (its pod template, as a Pod: kube play runs no Jobs) and its
Deployment, with the ConfigMap made from coordinator.env, on the coordinator image built by
`python -m localimages`, against a Postgres of the local postgres image on one Podman network.

What runs as written: the containers' args, envFrom the ConfigMap, the pod and container security
contexts (uid 10001, read-only root filesystem, no capabilities), the /tmp emptyDir, the
Deployment's replica count (one pod each). What the test changes: the image name (the local
build); each secretKeyRef becomes a literal value (kube play here cannot read a Kubernetes Secret
by reference); the containers' `ports` are dropped, the probes' named ports replaced by their
numbers (kube play would publish the ports on the host, which Kubernetes does not do: the second
replica could not bind 8000). What does not run here: the
Service, NetworkPolicy, HorizontalPodAutoscaler, PodDisruptionBudget, ServiceMonitor and
ServiceAccount (no cluster), the rolling-update strategy, and the probes as probes: Podman turns
the liveness probe into a health check `curl -f http://localhost:8000/healthz`, which only systemd
timers would run and which needs a curl the slim image does not have; the test checks that the
translation names /healthz and makes the liveness and readiness requests itself.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.deploy_config import REPO_ROOT

pytestmark = [pytest.mark.e2e]

BASE = REPO_ROOT / "deploy" / "k8s" / "base"
IMAGE = "localhost/spark-eos-coordinator:local"
SECRETS = {"database-url": "", "admin-token": "kube-play-admin", "token-secret": "kube-play-secret"}


def podman(*args: str, check: bool = True, timeout: float = 300):  # type: ignore[no-untyped-def]
    from localimages.podman import podman as run

    return run(*args, check=check, timeout=timeout)


@pytest.fixture
def network(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if "e2e" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("runs only when selected: python -m pytest -m e2e tests/e2e/test_e2e_kube_play.py")
    if shutil.which("podman") is None:
        pytest.skip("podman kube play needs Podman (.ci/e2e installs it)")
    from localimages.images import build_all

    build_all(["postgres", "coordinator"])
    name = f"eos-kube-{uuid.uuid4().hex[:6]}"
    podman("network", "create", name)
    try:
        yield name
    finally:
        for played in tmp_path.glob("*.yaml"):
            podman("kube", "down", str(played), check=False)
        podman("rm", "-f", "-t", "0", f"{name}-postgres", check=False)
        podman("network", "rm", "-f", name, check=False)


def manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((BASE / name).read_text())


def configmap() -> dict[str, Any]:
    data = {}
    for line in (BASE / "coordinator.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            data[key] = value
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "coordinator-config"}, "data": data}


def localized(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The pod spec with the local image and every secretKeyRef as a literal (what is not in
    SECRETS is optional: dropped, as Kubernetes drops an optional key a Secret lacks)."""
    spec = copy.deepcopy(pod_spec)
    for key in ("serviceAccountName", "automountServiceAccountToken", "topologySpreadConstraints"):
        spec.pop(key, None)
    for c in spec["containers"]:
        c["image"] = IMAGE
        named = {port["name"]: port["containerPort"] for port in c.pop("ports", []) if "name" in port}
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):  # named ports -> numbers
            get = c.get(probe, {}).get("httpGet")
            if get and get["port"] in named:
                get["port"] = named[get["port"]]
        env = []
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                env.append(e)
            elif ref["key"] in SECRETS:
                env.append({"name": e["name"], "value": SECRETS[ref["key"]]})
            else:
                assert ref.get("optional") is True, f"{e['name']}: a required secret key the test does not give"
        c["env"] = env
    return spec


def play(tmp_path: Path, network: str, name: str, docs: list[dict[str, Any]], *extra: str) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    podman("kube", "play", "--network", network, *extra, str(path), timeout=300)


def container_state(name: str) -> dict[str, Any]:
    return json.loads(podman("inspect", name).stdout)[0]


@pytest.mark.timeout(900)
def test_the_manifests_containers_run_under_podman_kube_play(network: str, tmp_path: Path) -> None:
    pg = f"{network}-postgres"
    podman("run", "-d", "--name", pg, "--network", network, "-e", "POSTGRES_USER=coordinator",
           "-e", "POSTGRES_PASSWORD=kube-play", "-e", "POSTGRES_DB=coordinator", "localhost/eos-local/postgres:15-bookworm")
    deadline = time.monotonic() + 120
    while podman("exec", pg, "pg_isready", "-U", "coordinator", "-d", "coordinator", check=False).returncode != 0:
        assert time.monotonic() < deadline, "postgres not ready"
        time.sleep(1)
    SECRETS["database-url"] = f"postgresql://coordinator:kube-play@{pg}:5432/coordinator"

    # the migration Job's pod template, as a Pod that runs once
    job = manifest("migration-job.yaml")
    spec = localized(job["spec"]["template"]["spec"])
    spec["restartPolicy"] = "Never"
    play(tmp_path, network, "migrate", [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "coordinator-migrate"},
                                         "spec": spec}])
    migrate = "coordinator-migrate-migrate"  # kube play names a container <pod>-<container>
    deadline = time.monotonic() + 180
    while (st := container_state(migrate)["State"])["Status"] != "exited":
        assert time.monotonic() < deadline, "the migration did not finish"
        time.sleep(2)
    assert st["ExitCode"] == 0, podman("logs", migrate, check=False).stderr[-3000:]

    # the Deployment with its ConfigMap
    deployment = manifest("deployment.yaml")
    deployment["spec"]["template"]["spec"] = localized(deployment["spec"]["template"]["spec"])
    cm = tmp_path / "configmap.yaml"
    cm.write_text(yaml.safe_dump(configmap()))
    play(tmp_path, network, "deployment", [deployment], "--configmap", str(cm))
    pods = json.loads(podman("pod", "ps", "--format", "json", "--filter", f"network={network}").stdout)
    names = sorted(p["Name"] for p in pods if p["Name"].startswith("coordinator-pod"))
    assert len(names) == deployment["spec"]["replicas"], names
    ready = ("import urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4); "
             "print(r.status, r.read().decode())")
    for name in names:
        ctr = f"{name}-coordinator"
        inspected = container_state(ctr)
        assert inspected["Config"]["User"].split(":")[0] == "10001"
        assert inspected["HostConfig"]["ReadonlyRootfs"] is True
        assert not inspected["EffectiveCaps"], inspected["EffectiveCaps"]
        env = dict(e.split("=", 1) for e in inspected["Config"]["Env"])
        assert env["COORDINATOR_MIGRATE_ON_START"] == "false" and env["COORDINATOR_WORKERS"] == "1"  # envFrom
        deadline = time.monotonic() + 120
        while (probe := podman("exec", ctr, "python", "-c", ready, check=False)).returncode != 0:
            assert time.monotonic() < deadline, f"/readyz never 200: {probe.stderr[-500:]}"
            time.sleep(2)
        assert probe.stdout.startswith("200") and '"ready"' in probe.stdout
        # the liveness probe becomes Podman's health check `curl -f http://localhost:8000/healthz`;
        # the image has no curl (slim), so the same request is made with Python
        check = " ".join(inspected["Config"]["Healthcheck"]["Test"])
        assert "http://localhost:8000/healthz" in check, check
        alive = podman("exec", ctr, "python", "-c", ready.replace("/readyz", "/healthz"), check=False)
        assert alive.returncode == 0 and alive.stdout.startswith("200"), alive.stderr
        # nothing written outside /tmp: the read-only root holds
        assert podman("exec", ctr, "touch", "/opt/venv/x", check=False).returncode != 0
    # one recovery leader among the pods
    deadline = time.monotonic() + 90
    scrape = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/metrics', timeout=4).read().decode())"
    while True:
        texts = [podman("exec", f"{n}-coordinator", "python", "-c", scrape).stdout for n in names]
        leaders = [line for t in texts for line in t.splitlines() if line.startswith("coordinator_recovery_leader ")]
        if sorted(float(x.split()[1]) for x in leaders) == [0.0] * (len(names) - 1) + [1.0]:
            break
        assert time.monotonic() < deadline, leaders
        time.sleep(3)
