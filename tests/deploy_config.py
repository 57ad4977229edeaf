"""What the deployment files must agree with, read from the code itself: the Settings fields
(coordinator/settings.py), the app's routes (coordinator/http/api.py), and small loaders for the
compose and kustomize files. Shared by tests/test_deploy_*.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV_PREFIX = "COORDINATOR_"
SECRET_NAME = "coordinator-secrets"
# settings whose values are secrets: only ever by reference (secretKeyRef), never a literal
SECRET_SETTINGS = {"COORDINATOR_DATABASE_URL", "COORDINATOR_ADMIN_TOKEN", "COORDINATOR_TOKEN_SECRET",
                   "COORDINATOR_KAFKA_SASL_PASSWORD", "COORDINATOR_DASHBOARD_VIEWER_TOKEN"}
# of those, the ones a deployment may leave out of its Secret (secretKeyRef optional: true)
OPTIONAL_SECRET_SETTINGS = {"COORDINATOR_KAFKA_SASL_PASSWORD", "COORDINATOR_DASHBOARD_VIEWER_TOKEN"}


def settings_env_names() -> set[str]:
    return {ENV_PREFIX + name.upper() for name in Settings.model_fields}


def settings_from_env(env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The Settings a process started with exactly `env` would read (validates every value)."""
    import os

    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings()


def get_routes(app: Any) -> set[str]:
    """Paths of the app's GET routes."""
    return {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or set())}


_DEFAULT = re.compile(r"\$\{([A-Z0-9_]+):-([^}]*)\}")


def substitute_defaults(text: str) -> str:
    """Compose's `${VAR:-default}` interpolation with nothing set: the defaults."""
    return _DEFAULT.sub(lambda m: m.group(2), text)


def load_compose(*names: str) -> dict[str, Any]:
    """The compose files merged the way `docker compose -f a -f b` merges them for what the tests
    look at: mappings merge key by key, `command`/`entrypoint`/lists are replaced."""
    merged: dict[str, Any] = {}
    for name in names:
        doc = yaml.safe_load(substitute_defaults((REPO_ROOT / name).read_text()))
        merged = _merge(merged, doc)
    return merged


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return override


def compose_env(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _kustomize_v5(kubectl: str) -> bool:
    out = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"Kustomize Version: v(\d+)", out)
    return found is not None and int(found.group(1)) >= 5


def kustomize(path: str) -> list[dict[str, Any]]:
    """`kubectl kustomize` (kustomize built into kubectl) of a kustomization directory."""
    kubectl = shutil.which("kubectl")
    if kubectl is None or not _kustomize_v5(kubectl):
        # Not installable from this project's registries: Debian only has kubectl 1.20, whose
        # kustomize v2 cannot read these files. Each plain manifest is still schema-checked.
        pytest.skip(
            "needs kubectl >= 1.27 (kustomize v5 built in), from https://kubernetes.io/docs/tasks/tools/; "
            "Debian's kubernetes-client 1.20 is too old"
        )
    proc = subprocess.run([kubectl, "kustomize", str(REPO_ROOT / path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]
