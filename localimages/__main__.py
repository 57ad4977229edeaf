"""python -m localimages build [NAME ...] | env | sizes   (see localimages/__init__.py)"""

from __future__ import annotations

import argparse
import sys
import time

from .images import IMAGES, build_all, compose_env
from .podman import image_labels, image_size, podman_problem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localimages", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build every image (or those whose name contains NAME) that changed")
    b.add_argument("names", nargs="*")
    sub.add_parser("env", help="print the compose variables that name the local images (KEY=VALUE lines)")
    sub.add_parser("sizes", help="the local images and their sizes")
    args = parser.parse_args(argv)
    if args.command == "env":
        for key, value in compose_env().items():
            print(f"{key}={value}")
        return 0
    problem = podman_problem()
    if problem:
        print(f"localimages: {problem}", file=sys.stderr)
        return 2
    if args.command == "sizes":
        for image in IMAGES:
            stored = image_labels(image.name) is not None
            size = f"{image_size(image.name) / 1e6:7.0f} MB" if stored else "  (not built)"
            print(f"{size}  {image.name}  (for {image.stands_for})")
        return 0
    started = time.monotonic()
    for built in build_all(args.names, say=lambda s: print(s, file=sys.stderr, flush=True)):
        state = "cached" if built.cached else "built"
        print(f"{state:6} {built.seconds:6.1f} s {built.size / 1e6:7.0f} MB  {built.image.name}", flush=True)
    print(f"localimages: done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
