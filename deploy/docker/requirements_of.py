"""Print the requirements one extra of an installed distribution adds, one per line:

    python requirements_of.py spark-kafka-exactly-once server > server-requirements.txt

The coordinator's image installs the project's wheel without dependencies, then these: the
service's [server] extra without the base requirements, which are the writer's (pyarrow, pandas,
numpy: ~300 MB the service never imports)."""

import sys
from importlib.metadata import requires


def requirements_of(distribution: str, extra: str) -> list[str]:
    found = []
    for requirement in requires(distribution) or []:
        spec, _, marker = requirement.partition(";")
        if marker.replace("'", '"').split() == ["extra", "==", f'"{extra}"']:
            found.append(spec.strip())
    return found


if __name__ == "__main__":
    lines = requirements_of(sys.argv[1], sys.argv[2])
    if not lines:
        sys.exit(f"{sys.argv[1]} has no requirement for the extra {sys.argv[2]!r}")
    print("\n".join(lines))
