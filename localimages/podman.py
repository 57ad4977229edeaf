"""Podman as the local images and the compose e2e use it: the settings file, commands, labels."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CONTAINERS_CONF = REPO_ROOT / "deploy" / "local" / "containers.conf"
CONTENT_LABEL = "eos.local.content"  # the content hash an image was built from
CNI_PLUGIN_DIRS = ("/usr/lib/cni", "/usr/libexec/cni", "/opt/cni/bin")


class PodmanError(RuntimeError):
    """A podman command failed; the message has its output's tail."""


def podman_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for podman and podman-compose: CONTAINERS_CONF names the repository's
    settings (runc, ulimits the host allows) unless the caller set one."""
    env = dict(os.environ if base is None else base)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def podman(*args: str, check: bool = True, timeout: float = 1800, quiet: bool = True,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `podman ARGS`; output captured (quiet) or passed through."""
    cmd = ["podman", *args]
    proc = subprocess.run(cmd, env=podman_env(), cwd=cwd, text=True, timeout=timeout,
                          capture_output=quiet)
    if check and proc.returncode != 0:
        tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).strip().splitlines()[-15:])
        raise PodmanError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return proc


def podman_problem() -> str | None:
    """Why Podman cannot run containers here, or None when it can."""
    if shutil.which("podman") is None:
        return "no podman on PATH (apt-get install -y podman runc mmdebstrap: .ci/e2e installs them)"
    try:
        info = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False, timeout=60)
    except subprocess.TimeoutExpired:
        return "`podman info` timed out"
    if info.returncode != 0:
        said = (info.stderr or info.stdout).strip().splitlines()
        return f"`podman info` failed: {said[-1] if said else info.returncode}"
    if not any(Path(d, "dnsname").exists() for d in CNI_PLUGIN_DIRS):
        return ("no CNI dnsname plugin (containers.conf uses CNI for its DNS): apt-get install -y "
                "golang-github-containernetworking-plugin-dnsname")
    return None


def image_labels(name: str) -> dict[str, str] | None:
    """The image's labels, or None when no such image is stored."""
    proc = podman("image", "inspect", name, check=False, timeout=60)
    if proc.returncode != 0:
        return None
    data = json.loads(proc.stdout)
    return (data[0].get("Labels") or {}) if data else None


def image_size(name: str) -> int:
    """The image's size in bytes (all its layers, as `podman images` counts it)."""
    data = json.loads(podman("image", "inspect", name, timeout=60).stdout)
    return int(data[0]["Size"])
