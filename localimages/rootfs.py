"""Base images from Debian's packages: `mmdebstrap` makes a minimal bookworm root filesystem with
the packages a base needs, `podman import` turns it into an image. No registry is involved: the
packages come from the host's own apt sources (the same mirror `apt-get` uses here)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .podman import CONTENT_LABEL, podman

SUITE = "bookworm"
# files of the host's apt configuration that name Debian's own archive, first found wins
APT_SOURCES = ("/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list")
# documentation, man pages and translations are not needed in an image
SLIM = ("path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
        "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/locale/*", "path-exclude=/usr/share/info/*")
# update-alternatives (openjdk's postinst) fails when man1 is missing (SLIM leaves it out): there
# while packages go in (essential hook), and in the image for those a Dockerfile adds (customize hook)
MAN1 = 'mkdir -p "$1/usr/share/man/man1"'


@dataclass(frozen=True)
class DebianBase:
    name: str                    # the image it becomes
    packages: tuple[str, ...]    # installed on top of Debian's minbase variant
    stands_for: str              # what it replaces
    customize: str = ""          # a shell command run on the finished root filesystem ("$1")
    changes: tuple[str, ...] = ("ENV LANG=C.UTF-8", 'CMD ["bash"]')  # `podman import --change`s


PYTHON = DebianBase(
    "localhost/eos-local/python:3.11-bookworm",
    ("python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates"),
    "python:3.11-slim-bookworm (the project Dockerfiles' base, PYTHON_IMAGE)",
    changes=("ENV LANG=C.UTF-8", 'CMD ["python3"]'))
JAVA = DebianBase(
    "localhost/eos-local/java:17-bookworm", ("openjdk-17-jre-headless", "passwd"),
    "the Java 17 runtime under the local Kafka image")
POSTGRES = DebianBase(
    "localhost/eos-local/postgresql-base:15-bookworm", ("postgresql-15",),
    "the PostgreSQL server under the local postgres image",
    # Debian's package creates a cluster at install; the image's entrypoint makes its own in PGDATA
    customize='rm -rf "$1/var/lib/postgresql/15" "$1/etc/postgresql/15"')
NGINX = DebianBase(
    "localhost/eos-local/nginx-base:1.22-bookworm", ("nginx-light", "wget"),
    "the nginx under the local balancer image")
BASES = (PYTHON, JAVA, POSTGRES, NGINX)


def apt_sources() -> Path:
    """The host's apt sources for Debian's archive (LOCALIMAGES_APT_SOURCES overrides)."""
    candidates = [os.environ["LOCALIMAGES_APT_SOURCES"]] if os.environ.get("LOCALIMAGES_APT_SOURCES") else APT_SOURCES
    for candidate in candidates:
        path = Path(candidate)
        if path.is_file() and SUITE in path.read_text():
            return path
    raise FileNotFoundError(f"no apt sources for Debian {SUITE} in {', '.join(candidates)}")


def content_hash(base: DebianBase) -> str:
    facts = {"base": [base.name, base.packages, base.customize, base.changes, SLIM, MAN1],
             "sources": apt_sources().read_text(), "suite": SUITE}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def build_base(base: DebianBase, digest: str) -> None:
    """mmdebstrap the root filesystem into a tarball, then import it as `base.name`."""
    with tempfile.TemporaryDirectory(prefix="localimages-rootfs-") as tmp:
        tar = Path(tmp) / "rootfs.tar"
        cmd = ["mmdebstrap", "--variant=minbase", "--quiet", "--include=" + ",".join(base.packages),
               *(f"--dpkgopt={opt}" for opt in SLIM), "--aptopt=Acquire::Retries \"3\"",
               f"--essential-hook={MAN1}", f"--customize-hook={MAN1}",
               *([f"--customize-hook={base.customize}"] if base.customize else []),
               SUITE, str(tar), str(apt_sources())]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"mmdebstrap for {base.name} failed:\n{tail}")
        changes = [*base.changes, f"LABEL {CONTENT_LABEL}={digest}"]
        podman("import", *(arg for c in changes for arg in ("--change", c)), str(tar), base.name, timeout=900)
