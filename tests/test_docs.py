"""The documentation holds: every relative link in README.md and docs/ resolves to a file, every
command of the README's command blocks exists (the extras it installs, the `coordinator`
subcommands it runs, pytest), and /docs and /redoc work offline (their assets come from the package)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from fixtures.servers import REPO_ROOT

from coordinator.http.api import create_app
from coordinator.service import Coordinator

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(path: Path) -> Iterator[str]:
    for target in LINK.findall(path.read_text()):
        if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
            yield target


def test_the_docs_pages_exist_and_the_readme_links_them_all() -> None:
    pages = {p.name for p in (REPO_ROOT / "docs").glob("*.md")}
    assert {"design.md", "protocol.md", "configuration.md", "operations.md", "runbook.md", "deployment.md",
            "metrics.md", "benchmarks.md"} <= pages
    linked = {Path(t).name for t in relative_links(REPO_ROOT / "README.md")}
    assert pages <= linked, f"docs pages the README does not link: {pages - linked}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    broken = [t for t in relative_links(path) if not (path.parent / t.split("#")[0]).exists()]
    assert not broken, f"{path.name}: links to missing files: {broken}"


# a file of the repository named in a page's text: `tests/http/test_api.py`, coordinator/service/commit.py
NAMED_FILE = re.compile(r"(?<![\w/.-])((?:tests|coordinator|sparkclient|sim|bench|deploy|docs)/[\w/.-]+\.(?:py|md|yaml|yml|sh|toml))")


def named_files(text: str) -> set[str]:
    return set(NAMED_FILE.findall(text))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_file_a_page_names_exists(path: Path) -> None:
    missing = sorted(f for f in named_files(path.read_text()) if not (REPO_ROOT / f).exists())
    assert not missing, f"{path.name} names files that do not exist (moved or removed?): {missing}"


SOURCES = sorted(p for d in ("coordinator", "sparkclient", "sim", "e2e", "bench", "localkafka", "tests")
                 for p in (REPO_ROOT / d).rglob("*.py")
                 if p.name not in ("test_docs.py", "test_architecture.py"))  # their examples are made up


def test_every_file_the_code_names_exists() -> None:
    """Comments and docstrings point to tests and modules by path; a move must take them along."""
    missing = {str(p.relative_to(REPO_ROOT)): gone for p in SOURCES
               if (gone := sorted(f for f in named_files(p.read_text()) if not (REPO_ROOT / f).exists()))}
    assert not missing, f"source files naming files that do not exist (moved or removed?): {missing}"


def test_the_named_file_check_sees_paths_in_prose_and_code() -> None:
    text = "see `tests/http/test_api.py`, coordinator/service/commit.py and (tests/test_gone.py); not x/tests/y.py"
    assert named_files(text) == {"tests/http/test_api.py", "coordinator/service/commit.py", "tests/test_gone.py"}
    assert not (REPO_ROOT / "tests/test_gone.py").exists()


def test_the_link_check_catches_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("see [the runbook](runbook.md) and [site](https://example.org) and [top](#top)")
    assert list(relative_links(page)) == ["runbook.md"]
    assert not (page.parent / "runbook.md").exists()


def readme_commands() -> list[list[str]]:
    """The commands of the README's bash blocks before the first section (the serve and test
    commands, the quickstart), split at `&&`."""
    readme = (REPO_ROOT / "README.md").read_text()
    head = readme.split("\n## ", 1)[0]
    out = []
    for block in re.findall(r"```bash\n(.*?)```", head, re.S):
        for line in block.splitlines():
            out += [shlex.split(part) for part in line.split("&&") if part.strip()]
    return out


def test_every_command_of_the_readmes_first_blocks_exists() -> None:
    commands = readme_commands()
    assert ["coordinator", "serve"] in commands and ["coordinator", "quickstart"] in commands
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    assert project["scripts"]["coordinator"] == "coordinator.cli:main"
    for cmd in commands:
        if cmd[:2] == ["pip", "install"]:
            spec = cmd[-1]
            m = re.fullmatch(r"\.(?:\[([a-z,]+)\])?", spec)
            assert m and "-e" in cmd, f"{cmd}: installs from the checkout, editable"
            assert set(filter(None, (m.group(1) or "").split(","))) <= extras, f"{cmd}: unknown extra"
        elif cmd[0] == "coordinator":
            out = subprocess.run([sys.executable, "-m", "coordinator.cli", *cmd[1:], "--help"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, f"{cmd}: {out.stderr}"
        elif cmd[:3] == ["python", "-m", "pytest"]:
            import pytest as _  # noqa: F401 - the test extra installs it
        else:
            raise AssertionError(f"a README command this test does not know: {cmd}")


def test_the_ci_script_runs_the_readmes_test_command() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "python -m pytest" in x)
    assert line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()


def test_swagger_ui_and_redoc_are_served_from_the_package(coordinator: Coordinator) -> None:
    with TestClient(create_app(coordinator, admin_token="a", token_secret=b"s")) as client:
        for page, assets in (("/docs", ["swagger-ui-bundle.js", "swagger-ui.css"]), ("/redoc", ["redoc.standalone.js"])):
            html = client.get(page)
            assert html.status_code == 200
            srcs = re.findall(r'(?:src|href)="([^"]+)"', html.text) + re.findall(r"url: '([^']+)'", html.text)
            assert not [s for s in srcs if s.startswith(("http:", "https:", "//"))], f"{page} loads from elsewhere: {srcs}"
            for asset in assets:
                assert f"/docs-assets/{asset}" in html.text
                got = client.get(f"/docs-assets/{asset}")
                assert got.status_code == 200 and len(got.content) > 100_000, asset


def generated_diagrams(page: str) -> str:
    return page.split("<!-- generated: python -m coordinator.protocol.diagrams -->\n", 1)[1].split(
        "\n<!-- end generated -->", 1)[0]


def test_the_protocols_state_diagrams_are_its_tables() -> None:
    """docs/protocol.md draws the state machines from coordinator/protocol/states.py's tables; a
    drawing made from another table (a transition added or removed) would not match."""
    from coordinator.protocol import diagrams
    from coordinator.protocol.states import LeaseState

    drawn = generated_diagrams((REPO_ROOT / "docs" / "protocol.md").read_text())
    assert drawn.strip() == diagrams.document().strip()
    changed = dict(diagrams.MACHINES)
    changed["lease"] = {**diagrams.LEASE_TRANSITIONS, LeaseState.ABORTED: frozenset({LeaseState.LEASED})}
    assert diagrams.document(changed).strip() != drawn.strip()
