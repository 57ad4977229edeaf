"""The Kubernetes manifests (deploy/k8s, deploy/grafana): every object of the rendered base and
example overlay validated offline against the Kubernetes JSON schemas (kubernetes-validate, which
bundles them; strict: unknown fields are errors), the ServiceMonitor against the structure the
Prometheus Operator's CRD defines for the fields used, and the files agreeing with each other and
with the service: selectors and labels, ports (= Settings.port), probe paths (= the app's routes),
environment names (= Settings fields), secrets only by reference."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from fixtures.deploy_config import (
    OPTIONAL_SECRET_SETTINGS,
    REPO_ROOT,
    SECRET_NAME,
    SECRET_SETTINGS,
    get_routes,
    kustomize,
    one,
    settings_env_names,
    settings_from_env,
)

from coordinator.http.api import create_app
from coordinator.service import Coordinator

KUSTOMIZATIONS = ["deploy/k8s/base", "deploy/k8s/overlays/example"]
# the oldest Kubernetes the manifests claim (autoscaling/v2, policy/v1, seccompProfile fields)
# and the newest whose schemas kubernetes-validate bundles
K8S_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]
SELECTOR = {"app.kubernetes.io/name": "spark-eos-coordinator", "app.kubernetes.io/component": "coordinator"}

# The ServiceMonitor fields used here, as the monitoring.coreos.com/v1 CRD defines them (it is not
# among the core schemas); additionalProperties false so that a misspelt field fails.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {"type": "object"},
                "selector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                                   "matchExpressions": {"type": "array"}},
                },
                "endpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {k: kustomize(k) for k in KUSTOMIZATIONS}


@pytest.fixture(scope="module")
def overlay(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered["deploy/k8s/overlays/example"]


@pytest.fixture
def routes(coordinator: Coordinator) -> set[str]:
    return get_routes(create_app(coordinator, admin_token="t", token_secret=b"s"))


def validate(obj: dict[str, Any], version: str) -> None:
    if obj["apiVersion"] == "monitoring.coreos.com/v1":
        jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


def test_every_rendered_object_is_valid_for_kubernetes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for path, objects in rendered.items():
        kinds = sorted(o["kind"] for o in objects)
        assert kinds == sorted(["ConfigMap", "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Job", "NetworkPolicy",
                                "PodDisruptionBudget", "Service", "ServiceAccount", "ServiceMonitor"]
                               + (["Namespace"] if "overlays" in path else [])), (path, kinds)
        for obj in objects:
            for version in K8S_VERSIONS:
                try:
                    validate(obj, version)
                except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
                    raise AssertionError(f"{path}: {obj['kind']}/{obj['metadata']['name']} invalid for {version}: {exc}") from exc


def test_the_validators_reject_what_kubernetes_would(overlay: list[dict[str, Any]]) -> None:
    deployment = json.loads(json.dumps(one(overlay, "Deployment")))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGet"]["port"] = ["http"]  # wrong type
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, K8S_VERSIONS[-1])
    deployment = json.loads(json.dumps(one(overlay, "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}  # misspelt: strict refuses
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, K8S_VERSIONS[-1])
    monitor = json.loads(json.dumps(one(overlay, "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor, K8S_VERSIONS[-1])


def test_every_file_of_the_base_is_part_of_it() -> None:
    base = REPO_ROOT / "deploy/k8s/base"
    k = yaml.safe_load((base / "kustomization.yaml").read_text())
    used = set(k["resources"]) | {f for g in k.get("configMapGenerator", []) for f in g.get("envs", []) + g.get("files", [])}
    files = {p.name for p in base.iterdir() if p.name != "kustomization.yaml"}
    assert files <= used, f"files in the base that no kustomization uses: {sorted(files - used)}"


def test_selectors_labels_and_ports_agree(overlay: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = one(overlay, "Deployment")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == SELECTOR
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"):
        obj = one(overlay, kind)
        sel = {"Service": lambda o: o["spec"]["selector"],
               "PodDisruptionBudget": lambda o: o["spec"]["selector"]["matchLabels"],
               "NetworkPolicy": lambda o: o["spec"]["podSelector"]["matchLabels"],
               "ServiceMonitor": lambda o: o["spec"]["selector"]["matchLabels"]}[kind](obj)
        target = one(overlay, "Service")["metadata"]["labels"] if kind == "ServiceMonitor" else labels
        assert sel.items() <= target.items(), (kind, sel, target)
    # the migration Job's pods must not be taken for serving replicas
    job_labels = one(overlay, "Job")["spec"]["template"]["metadata"]["labels"]
    assert not SELECTOR.items() <= job_labels.items()

    config = one(overlay, "ConfigMap", next(o["metadata"]["name"] for o in overlay
                                           if o["metadata"]["name"].startswith("coordinator-config")))
    settings = settings_from_env(config["data"], monkeypatch)
    assert settings.host == "0.0.0.0", "a pod must listen on all interfaces"
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.port}
    service_port = one(overlay, "Service")["spec"]["ports"][0]
    assert service_port["targetPort"] in ports and service_port["name"] == "http"
    assert one(overlay, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == service_port["name"]
    assert one(overlay, "NetworkPolicy")["spec"]["ingress"][0]["ports"][0]["port"] in ports
    hpa = one(overlay, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert deployment["spec"]["replicas"] >= 2 and hpa["spec"]["minReplicas"] >= 2
    assert one(overlay, "PodDisruptionBudget")["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]
    # the example overlay's Kafka client settings are JSON the settings accept, without a password
    assert settings.kafka_client_config["security_protocol"] == "SASL_SSL"
    assert "sasl_plain_password" not in settings.kafka_client_config
    assert settings.migrate_on_start is False, "the migration Job migrates; replicas must not race it"


def test_probes_and_scrape_path_are_real_routes_of_the_app(overlay: list[dict[str, Any]], routes: set[str]) -> None:
    container = one(overlay, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] in routes, probe
        assert container[probe]["httpGet"]["port"] == "http"
    assert one(overlay, "ServiceMonitor")["spec"]["endpoints"][0]["path"] in routes
    assert {"/readyz", "/healthz", "/metrics"} <= routes  # (the check above is against these)


def test_environment_names_are_settings_and_secrets_come_only_by_reference(
    rendered: dict[str, list[dict[str, Any]]]
) -> None:
    fields = settings_env_names()
    for path, objects in rendered.items():
        assert not [o for o in objects if o["kind"] == "Secret"], f"{path} renders a Secret: secrets are the operator's"
        config = next(o for o in objects if o["metadata"]["name"].startswith("coordinator-config"))
        assert set(config["data"]) <= fields, sorted(set(config["data"]) - fields)
        # /metrics is per process and Prometheus scrapes one process per pod
        assert config["data"].get("COORDINATOR_WORKERS", "1") == "1", f"{path}: one worker per pod"
        assert not set(config["data"]) & SECRET_SETTINGS
        for kind in ("Deployment", "Job"):
            pod = one(objects, kind)["spec"]["template"]["spec"]
            for c in pod["containers"]:
                for env in c.get("env", []):
                    assert env["name"] in fields, f"{kind}: {env['name']} is not a Settings field"
                    if env["name"] in SECRET_SETTINGS:
                        assert "value" not in env, f"{kind}: {env['name']} has a literal value"
                        ref = env["valueFrom"]["secretKeyRef"]
                        assert ref["name"] == SECRET_NAME
                        assert ref.get("optional", False) == (env["name"] in OPTIONAL_SECRET_SETTINGS), \
                            f"{kind}: {env['name']} optional must be {env['name'] in OPTIONAL_SECRET_SETTINGS}"
                for src in c.get("envFrom", []):
                    assert "configMapRef" in src, src
        deployment_env = {e["name"] for e in one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert deployment_env == SECRET_SETTINGS


def test_no_file_under_deploy_holds_a_literal_secret() -> None:
    suspicious = [
        re.compile(r"postgres(ql)?://[^:\s/]+:[^@\s$]+@"),  # a URL with a password
        re.compile(r"(?i)(password|passwd|token|secret)\s*[:=]\s*['\"]?[A-Za-z0-9+/_\-]{12,}"),
        re.compile(r"(?i)sasl_plain_password"),
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    ]
    allowed = {"token-secret", "coordinator-secrets"}  # key and Secret names, not values
    found = []
    for path in sorted((REPO_ROOT / "deploy").rglob("*")):
        if path.is_file() and path.suffix in {".yaml", ".yml", ".env", ".json", ".conf"}:
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if any(p.search(line) for p in suspicious) and not any(a in line for a in allowed):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_pods_run_non_root_read_only_without_privileges(overlay: list[dict[str, Any]]) -> None:
    for kind in ("Deployment", "Job"):
        pod = one(overlay, kind)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        mounts_tmp = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]}.get("/tmp") in mounts_tmp
            assert set(c["resources"]["requests"]) == {"cpu", "memory"} == set(c["resources"]["limits"])


def test_the_migration_job_runs_the_same_image_with_migrate(overlay: list[dict[str, Any]]) -> None:
    job = one(overlay, "Job")["spec"]["template"]["spec"]["containers"][0]
    serve = one(overlay, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert job["image"] == serve["image"] == "registry.example.com/spark-eos/coordinator:0.1.0"
    assert job["args"] == ["migrate"] and serve["args"] == ["serve"]
    from coordinator.cli import main

    with pytest.raises(SystemExit) as exc:  # both are real subcommands of the image's entrypoint
        main(["migrate", "--help"])
    assert exc.value.code == 0
    assert {e["name"] for e in job["env"]} == {"COORDINATOR_DATABASE_URL"}
    assert all(o["metadata"].get("namespace") == "spark-eos" for o in overlay if o["kind"] != "Namespace")


def test_the_grafana_dashboard_ships_as_a_labelled_configmap(overlay: list[dict[str, Any]]) -> None:
    cm = one(overlay, "ConfigMap", "coordinator-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = json.loads((REPO_ROOT / "deploy/grafana/coordinator-dashboard.json").read_text())
    assert json.loads(cm["data"]["coordinator-dashboard.json"]) == source
    assert source["title"] and isinstance(source["panels"], list) and source["panels"]


def test_each_base_manifest_file_is_valid_on_its_own() -> None:
    """Without kustomize too: each plain manifest of the base, as written, against the schemas."""
    base = REPO_ROOT / "deploy/k8s/base"
    resources = yaml.safe_load((base / "kustomization.yaml").read_text())["resources"]
    for name in resources:
        path = base / name
        if path.is_dir() or not Path(name).suffix == ".yaml":
            continue
        for obj in yaml.safe_load_all(path.read_text()):
            validate(obj, K8S_VERSIONS[-1])
