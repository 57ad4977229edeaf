"""Every image the compose files name, and how each is built here (cached by content hash).

The stand-ins for official images (postgres, apache/kafka, nginx) are built from
deploy/local/<name>/Containerfile on a Debian base; the project's own images from its Dockerfiles
with PYTHON_IMAGE pointing at the Debian-built Python base and the host-built wheels and jars in
deploy/image-inputs/. An image is rebuilt only when what it is built from changed: each carries
the hash of its inputs in the label eos.local.content.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import inputs, rootfs
from .podman import CONTENT_LABEL, REPO_ROOT, image_labels, image_size, podman

KAFKA_VERSION = "4.1.0"  # = the tag of the apache/kafka image docker-compose.yml names
LOCAL = REPO_ROOT / "deploy" / "local"
# what the project's Dockerfiles copy from the repository (their build context is its root)
PROJECT_SOURCES = ("pyproject.toml", "README.md", "coordinator", "migrations", "sparkclient", "e2e", "localkafka",
                   ".dockerignore")


@dataclass(frozen=True)
class Image:
    name: str                  # the local tag
    stands_for: str            # the official image (or the project's image) it is
    variable: str | None       # the compose variable that names it (None: compose names it already)
    kind: str                  # "base" (mmdebstrap), "stand-in" (deploy/local/...), "project" (a Dockerfile)
    base: rootfs.DebianBase
    dockerfile: str = ""       # stand-in: deploy/local/<dockerfile>/Containerfile; project: its path


IMAGES = (
    Image(rootfs.PYTHON.name, "python:3.11-slim-bookworm", "PYTHON_IMAGE", "base", rootfs.PYTHON),
    Image("localhost/eos-local/postgres:15-bookworm", "postgres:17-bookworm", "POSTGRES_IMAGE", "stand-in",
          rootfs.POSTGRES, "postgres"),
    Image(f"localhost/eos-local/kafka:{KAFKA_VERSION}", f"apache/kafka:{KAFKA_VERSION}", "KAFKA_IMAGE", "stand-in",
          rootfs.JAVA, "kafka"),
    Image("localhost/eos-local/nginx:1.22-bookworm", "nginx:1.28-alpine", "BALANCER_IMAGE", "stand-in",
          rootfs.NGINX, "balancer"),
    Image("localhost/spark-eos-coordinator:local", "spark-eos-coordinator:local (Dockerfile)", None, "project",
          rootfs.PYTHON, "Dockerfile"),
    Image("localhost/spark-eos-job:local", "spark-eos-job:local (deploy/docker/spark-job.Dockerfile)", None,
          "project", rootfs.PYTHON, "deploy/docker/spark-job.Dockerfile"),
)


@dataclass(frozen=True)
class Built:
    image: Image
    cached: bool
    seconds: float
    size: int


def compose_env() -> dict[str, str]:
    """The variables that make the compose files use the local images instead of the official ones."""
    return {i.variable: i.name for i in IMAGES if i.variable}


def _image_id(name: str) -> str:
    return podman("image", "inspect", "--format", "{{.Id}}", name, timeout=60).stdout.strip()


def _base_id(base: rootfs.DebianBase) -> str:
    return _image_id(base.name)[:16]


def _stage_stand_in(image: Image, directory: Path) -> None:
    """The stand-in's build context: its deploy/local/ directory, plus Kafka's jars for Kafka."""
    shutil.copytree(LOCAL / image.dockerfile, directory, dirs_exist_ok=True)
    if image.dockerfile == "kafka":
        inputs.link_files(inputs.kafka_jars(KAFKA_VERSION), directory / "libs")


def _digest(image: Image, staged: Path | None) -> str:
    if image.kind == "base":
        return rootfs.content_hash(image.base)
    if image.kind == "stand-in":
        assert staged is not None
        return inputs.tree_hash([staged], staged.parent) + _base_id(image.base)
    return inputs.tree_hash([REPO_ROOT / image.dockerfile, inputs.INPUTS,
                             *(REPO_ROOT / p for p in PROJECT_SOURCES)]) + _base_id(image.base)


def build(image: Image, *, say=print) -> Built:  # type: ignore[no-untyped-def]
    """Build `image` unless one built from the same content is stored; its base first."""
    started = time.monotonic()
    if image.kind != "base":
        build(Image(image.base.name, image.base.stands_for, None, "base", image.base), say=say)
    with tempfile.TemporaryDirectory(prefix="localimages-context-") as tmp:
        staged = None
        if image.kind == "stand-in":
            staged = Path(tmp) / image.dockerfile
            _stage_stand_in(image, staged)
        if image.kind == "project":  # both Dockerfiles copy all of deploy/image-inputs/: all of it first
            inputs.ensure_wheels()
            inputs.ensure_spark_jars()
        digest = _digest(image, staged)
        labels = image_labels(image.name)
        if labels is not None and labels.get(CONTENT_LABEL) == digest:
            return Built(image, True, time.monotonic() - started, image_size(image.name))
        say(f"localimages: building {image.name} ({image.kind}, stands for {image.stands_for}) ...")
        if image.kind == "base":
            rootfs.build_base(image.base, digest)
        else:
            context = staged if staged is not None else REPO_ROOT
            dockerfile = (staged / "Containerfile") if staged is not None else REPO_ROOT / image.dockerfile
            arg = f"BASE={image.base.name}" if staged is not None else f"PYTHON_IMAGE={image.base.name}"
            # --no-cache: buildah's own layer cache reused a COPY whose .dockerignore'd content had
            # changed; this module's content hash decides when to build instead. --format docker keeps
            # HEALTHCHECK and SHELL, which the OCI format drops
            podman("build", "--pull=never", "--no-cache", "--format", "docker", "--build-arg", arg,
                   "--label", f"{CONTENT_LABEL}={digest}", "-f", str(dockerfile), "-t", image.name, str(context),
                   timeout=3600)
    # the replaced build and the build stages: untagged images of this module's (none in use)
    podman("image", "prune", "-f", "--filter", f"label={CONTENT_LABEL}", check=False, timeout=600)
    seconds = time.monotonic() - started
    say(f"localimages: built {image.name} in {seconds:.0f} s")
    return Built(image, False, seconds, image_size(image.name))


def build_all(names: list[str] | None = None, *, say=print) -> list[Built]:  # type: ignore[no-untyped-def]
    chosen = [i for i in IMAGES if not names or any(n in i.name for n in names)]
    return [build(i, say=say) for i in chosen]
