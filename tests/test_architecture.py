"""The layout of the code, checked (docs/architecture.md, issue 16).

The import graph of coordinator/, sparkclient/, sim/ and bench/ is built from the source with
`ast`: every import statement, at module level or inside a function, a class or an
`if TYPE_CHECKING:` block, relative or absolute. On that graph:
- no cycles (no two modules import each other, directly or around a loop);
- the layers of coordinator/ point inward: protocol/ imports nothing of the project outside
  itself; store/ and kafka/ only the core (and each itself); service/ no HTTP or CLI; http/ no
  CLI; nothing imports app.py (it wires; uvicorn loads it by name); sparkclient/ (the client
  side, installed on Spark's executors without the server's stack) imports nothing of coordinator/;
- no module above MAX_LINES lines;
- every query in store/: outside it, coordinator/ takes from SQLAlchemy only the types it passes
  around (Connection, Engine) and its exceptions, never a statement builder (select, text, ...).

The checker is itself tested on a synthetic tree with a cycle, an outward import, a long module and
a query outside store/, each of which it must report.

An import of `a.b.c` is an edge to `a.b.c` only, not to the packages `a` and `a.b` whose
`__init__` Python also runs: a package's `__init__` that imports its own submodules would
otherwise make a cycle of every submodule that names a sibling. `from pkg import name` is an edge
to `pkg.name` when that is a module, else to `pkg`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "sparkclient", "sim", "bench")
MAX_LINES = 500
# what coordinator/ outside store/ may take from SQLAlchemy: the types it passes around
SQLALCHEMY_OUTSIDE_STORE = {"Connection", "Engine"}

# coordinator's layers, innermost first; each may import the ones listed for it (and itself)
LAYERS = ("protocol", "store", "kafka", "service", "http", "cli")
ALLOWED: dict[str, set[str]] = {
    "protocol": {"protocol"},
    "store": {"protocol", "store", "root"},
    "kafka": {"protocol", "kafka", "root"},
    "service": {"protocol", "store", "kafka", "service", "root"},
    "http": {"protocol", "store", "kafka", "service", "http", "root", "logs"},
    "cli": {"protocol", "store", "kafka", "service", "http", "cli", "root", "settings", "logs"},
    "settings": {"protocol", "root"},
    "logs": set(),
    "root": set(),
    "app": {"protocol", "store", "kafka", "service", "http", "root", "settings", "logs"},
}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            modules[module_name(root, path)] = path
    return modules


def _script_dir_module(importer: str, name: str, modules: dict[str, Path]) -> str | None:
    """bench/'s scripts import each other as top-level modules (`from measure import ...`, with
    bench/ on sys.path)."""
    top = importer.split(".")[0]
    candidate = f"{top}.{name}"
    return candidate if top == "bench" and candidate in modules else None


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _project_module(name: str, importer: str, modules: dict[str, Path]) -> str | None:
    if name in modules:
        return name
    return _script_dir_module(importer, name, modules)


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Each project module -> the project modules it imports (anywhere in its source)."""
    modules = collect_modules(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for importer, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(importer, is_package, node)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if _project_module(submodule, importer, modules) else base)
            for target in targets:
                found = _project_module(target, importer, modules)
                if found is None and "." in target:  # `import a.b.c` of a module we do not have: its package
                    found = _project_module(target.rsplit(".", 1)[0], importer, modules)
                if found is not None and found != importer:
                    graph[importer].add(found)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative, so a deep graph cannot hit the recursion limit
        nonlocal counter
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def layer_of(module: str) -> str | None:
    """coordinator's layer of a module; None outside coordinator/."""
    parts = module.split(".")
    if parts[0] != "coordinator":
        return None
    if len(parts) == 1:
        return "root"
    if parts[1] in LAYERS:
        return parts[1]
    if parts[1] in ("settings", "logs", "app"):
        return parts[1]
    return "unknown"


def outward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layer order, as "importer -> imported (layer -> layer)"."""
    found = []
    for importer, imported in sorted(graph.items()):
        source = layer_of(importer)
        for target in sorted(imported):
            dest = layer_of(target)
            if source is None:
                if importer.startswith("sparkclient") and dest is not None:
                    found.append(f"{importer} -> {target} (sparkclient -> coordinator)")
                continue
            if dest is None:
                found.append(f"{importer} -> {target} (coordinator -> outside)")
            elif source == "unknown" or dest not in ALLOWED[source]:
                found.append(f"{importer} -> {target} ({source} -> {dest})")
    return found


def long_modules(modules: dict[str, Path], max_lines: int = MAX_LINES) -> list[str]:
    found = []
    for name, path in sorted(modules.items()):
        lines = path.read_text().count("\n")
        if lines > max_lines:
            found.append(f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}: {lines} lines")
    return found


def queries_outside_store(modules: dict[str, Path]) -> list[str]:
    """Every coordinator module outside store/ that takes a statement builder from SQLAlchemy."""
    found = []
    for name, path in sorted(modules.items()):
        if layer_of(name) in (None, "store"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "sqlalchemy":
                taken = {alias.name for alias in node.names} - SQLALCHEMY_OUTSIDE_STORE
                if taken:
                    found.append(f"{name} takes {sorted(taken)} from sqlalchemy")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy.") \
                    and node.module != "sqlalchemy.exc":
                found.append(f"{name} imports from {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("sqlalchemy") for a in node.names):
                found.append(f"{name} imports sqlalchemy whole")
    return found


# --- the checks on the real code ---------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(REPO_ROOT, PACKAGES)


def test_the_graph_sees_the_project(graph: dict[str, set[str]]) -> None:
    # the checks below mean something only if the graph found the modules and their imports
    assert "coordinator.protocol.rules" in graph and "coordinator.http.api" in graph
    assert "coordinator.service" in graph["coordinator.http.api"]
    assert "bench.measure" in graph["bench.protocol_bench"]  # bench's script-style imports
    assert "coordinator.kafka.wire.control_plane" in graph["coordinator.kafka"]  # a function-level import
    assert sum(map(len, graph.values())) > 100


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert find_cycles(graph) == []


def test_imports_point_inward(graph: dict[str, set[str]]) -> None:
    assert outward_imports(graph) == []


def test_no_module_is_long() -> None:
    assert long_modules(collect_modules(REPO_ROOT, PACKAGES)) == []


def test_every_query_is_in_store() -> None:
    assert queries_outside_store(collect_modules(REPO_ROOT, PACKAGES)) == []


# --- the checker on a deliberately broken tree ---------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_catches_a_cycle_an_outward_import_a_long_module_and_a_query_outside_store(tmp_path: Path) -> None:
    long_body = '"""A module that is too long."""\n' + "x = 1\n" * (MAX_LINES + 1)
    short_body = '"""A module just short enough."""\n' + "x = 1\n" * (MAX_LINES - 1)
    _write(tmp_path, {
        "coordinator/__init__.py": "",
        "coordinator/protocol/__init__.py": "",
        # the core reaching out to the store, inside a function: still an import
        "coordinator/protocol/rules.py": "def f():\n    from ..store import repo\n",
        "coordinator/store/__init__.py": "",
        "coordinator/store/repo.py": "from ..protocol import rules\n",
        # a cycle through a TYPE_CHECKING block and an absolute import
        "coordinator/kafka/__init__.py": "",
        "coordinator/kafka/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n",
        "coordinator/kafka/b.py": "import coordinator.kafka.a\n",
        "coordinator/service/__init__.py": "",
        "coordinator/service/ops.py": "from ..http import api\n",  # outward: service -> http
        "coordinator/http/__init__.py": "",
        "coordinator/http/api.py": "from ..service import ops\n",  # with the line above: a cycle
        "coordinator/http/big.py": long_body,
        "coordinator/http/fits.py": short_body,
        "coordinator/service/query.py": "from sqlalchemy import Connection, select\n",
        "coordinator/service/fine.py": "from sqlalchemy import Connection, Engine\nfrom sqlalchemy.exc import DBAPIError\n",
        "coordinator/store/query.py": "from sqlalchemy import select, text\n",
        "sparkclient/__init__.py": "from coordinator.protocol import rules\n",
        "bench/measure.py": "",
        "bench/one.py": "from measure import x\n",
    })
    graph = import_graph(tmp_path, PACKAGES)
    assert graph["bench.one"] == {"bench.measure"}
    assert find_cycles(graph) == [
        ["coordinator.http.api", "coordinator.service.ops"],
        ["coordinator.kafka.a", "coordinator.kafka.b"],
        ["coordinator.protocol.rules", "coordinator.store.repo"],
    ]
    assert outward_imports(graph) == [
        "coordinator.protocol.rules -> coordinator.store.repo (protocol -> store)",
        "coordinator.service.ops -> coordinator.http.api (service -> http)",
        "sparkclient -> coordinator.protocol.rules (sparkclient -> coordinator)",
    ]
    long = long_modules(collect_modules(tmp_path, PACKAGES))
    assert len(long) == 1 and long[0].endswith(f"big.py: {MAX_LINES + 2} lines")
    assert queries_outside_store(collect_modules(tmp_path, PACKAGES)) == [
        "coordinator.service.query takes ['select'] from sqlalchemy"]
