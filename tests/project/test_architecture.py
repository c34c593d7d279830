"""The house rules, checked: layer contracts (import-linter), no private names across modules,
no file over about 500 lines without its reason, every module in docs/ARCHITECTURE.md's tree,
no Docker vocabulary outside the Docker backend and the CLI.
docs/ARCHITECTURE.md explains them."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("orchestrator", "orchestrator_runtime")
MAX_LINES = 500
#: What a file over MAX_LINES says at its top, followed by why.
LONG_FILE_REASON = "Over 500 lines for a reason:"


def source_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter on the packages under `root`, with the contracts of pyproject.toml."""
    command = [str(Path(sys.executable).parent / "lint-imports"), "--config", "pyproject.toml"]
    return subprocess.run(
        command,
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_layer_contracts_hold() -> None:
    out = lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_a_backend_importing_the_cli_breaks_the_contracts(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    sandbox = tmp_path / "orchestrator" / "backends" / "docker" / "backend.py"
    sandbox.write_text(sandbox.read_text() + "\nfrom ...cli import main  # noqa\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0
    assert "layers: the CLI on top, plain data at the bottom BROKEN" in out.stdout
    assert "orchestrator.backends.docker.backend -> orchestrator.cli" in out.stdout


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_private_name_is_imported_from_another_module(path: Path) -> None:
    tree = ast.parse(path.read_text())
    private = [
        f"{node.module}.{alias.name} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not private, f"private names imported: {private}; make them public or move them"


def test_no_file_is_over_500_lines_without_its_reason() -> None:
    long = [
        f"{path.relative_to(REPO)} ({count} lines)"
        for path in source_files()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
        and LONG_FILE_REASON not in path.read_text()[:3000]
    ]
    assert not long, f"split these, or say at their top why not: {long}"


#: The longest function a reader should have to hold in their head.
MAX_FUNCTION_LINES = 100
#: Modules directly in orchestrator/ (the core data and rules, __init__ and __main__): the
#: rest lives in sub-packages by concern.
MAX_TOP_MODULES = 12


def test_no_function_is_over_100_lines() -> None:
    long = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)"
        for path in source_files()
        if path.is_relative_to(REPO / "orchestrator")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert not long, f"tell these in named steps: {long}"


def test_every_formatter_exception_says_why() -> None:
    """`ruff format` runs in CI; a line kept out of it says on the same line why."""
    bare = [
        f"{path.relative_to(REPO)}:{number}"
        for path in tracked_python_files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"#\s*fmt:\s*(skip|off)\s*$", line)
    ]
    assert not bare, f"add the reason after the marker (`# fmt: skip - why`): {bare}"


def test_few_modules_sit_directly_in_the_package() -> None:
    top = sorted(path.name for path in (REPO / "orchestrator").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"move some into a sub-package by concern: {top}"


def test_no_test_cites_an_internal_issue_number() -> None:
    """A newcomer cannot look them up: a test says what it checks."""
    cited = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bissue\s+[0-9]", line, re.IGNORECASE)
    ]
    assert not cited, f"say what the test checks instead: {cited}"


def tracked_python_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [REPO / name for name in listed.stdout.split()]


#: The heading of docs/ARCHITECTURE.md's tree; its first fenced block is the tree.
TREE_HEADING = "## The tree, one line per module"
#: An entry's indentation is two spaces a level, at most this deep; deeper lines continue the
#: entry above (its description).
MAX_ENTRY_INDENT = 8


def documented_tree(text: str) -> tuple[set[str], set[str]]:
    """The packages and modules docs/ARCHITECTURE.md's tree names, as paths from the
    repository's root: one entry per line, `name.py` a module of the package above it,
    `name/` a package; deeper lines continue the entry above (its description) and name
    nothing. Raises AssertionError when the document has no tree."""
    block = text.split(TREE_HEADING, 1)[1].split("```", 2)[1]
    packages: set[str] = set()
    modules: set[str] = set()
    parents: dict[int, str] = {}  # indentation -> the package an entry there belongs to
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        name, _, rest = line.strip().partition(" ")
        if indent > MAX_ENTRY_INDENT:  # a description going on
            continue
        assert indent % 2 == 0 and (indent == 0 or indent - 2 in parents), (
            f"tree line at an unexpected indentation: {line!r}"
        )
        path = f"{parents[indent - 2]}/{name}" if indent else name
        if name.endswith("/"):
            path = path.rstrip("/")
            packages.add(path)
            parents[indent] = path
        else:
            assert name.endswith(".py"), f"tree entry neither a module nor a package: {line!r}"
            modules.add(path)
        for deeper in [level for level in parents if level > indent]:
            del parents[deeper]
    return packages, modules


def tree_on_disk() -> tuple[set[str], set[str]]:
    """The packages (folders with an `__init__.py`) and modules of PACKAGES, `__init__.py`
    left out (its package's entry stands for it)."""
    packages = {
        str(init.parent.relative_to(REPO))
        for package in PACKAGES
        for init in (REPO / package).rglob("__init__.py")
    }
    modules = {
        str(path.relative_to(REPO))
        for path in source_files()
        if path.name != "__init__.py" and str(path.parent.relative_to(REPO)) in packages
    }
    return packages, modules


def test_every_module_is_in_the_architecture_tree() -> None:
    doc_packages, doc_modules = documented_tree((REPO / "docs" / "ARCHITECTURE.md").read_text())
    packages, modules = tree_on_disk()
    missing = sorted((packages - doc_packages) | (modules - doc_modules))
    assert not missing, (
        f"not in docs/ARCHITECTURE.md's tree: {missing}; add a line for each module, under "
        "its package's line"
    )
    gone = sorted(path for path in doc_packages | doc_modules if not (REPO / path).exists())
    assert not gone, f"docs/ARCHITECTURE.md's tree names what does not exist: {gone}"


def test_the_tree_check_sees_a_missing_module() -> None:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    packages, modules = documented_tree(text)
    assert {"orchestrator/lifecycle/runner.py", "orchestrator/backends/base.py"} <= modules
    assert {"orchestrator/backends/docker/egress.py", "orchestrator/batch/session.py"} <= modules
    assert {"orchestrator/backends/docker", "orchestrator_runtime/gateway"} <= packages
    without = re.sub(r"\n    pool\.py [^\n]*", "", text)
    without = re.sub(r"\n      egress\.py [^\n]*", "", without)
    _, fewer = documented_tree(without)
    assert modules - fewer == {
        "orchestrator/execution/pool.py",
        "orchestrator/backends/docker/egress.py",
    }


def test_every_status_has_its_exit_code() -> None:
    from typing import get_args

    from orchestrator.spec import EXIT_CODES, RunStatus

    assert set(EXIT_CODES) == set(get_args(RunStatus))


# ---- no Docker vocabulary in backend-neutral code ------------------------------------------

#: Where Docker may be named: its backend, and the CLI (whose help names it as one choice).
DOCKER_PLACES = ("orchestrator/backends/docker/", "orchestrator/cli/")
#: What must name Docker outside those places (file -> its words), and why.
DOCKER_ALLOWED = {
    # E2B asks the local engine for its base image's Python when this machine has one
    # (imported there only, any failure means "cannot tell": E2B never needs Docker).
    "orchestrator/backends/e2b/templates.py": {"import docker", "docker"},
}


def docker_words(source: str) -> list[str]:
    """Identifiers that contain `docker` (names, attributes, definitions, arguments) and
    imports of `docker`, as `what` strings; string values (the registry's entry "docker",
    an environment variable's name) are data, not vocabulary."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "docker"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "docker":
            found.append(f"from {node.module} import")
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, ast.alias) and node.asname:  # the imported name: above
            names = [node.asname]
        found += [f"line {node.lineno}: {n}" for n in names if "docker" in n.lower()]
    return found


def test_backend_neutral_code_has_no_docker_vocabulary() -> None:
    """Docker is one backend: code outside its package says what it means ("this host", a
    capability, the registry's default backend), so a newcomer's backend fits in."""
    bad = "import docker.errors\nfrom docker import types\ndef f(on_docker_host): x.is_docker()"
    assert len(docker_words(bad)) == 4  # the scan sees what it looks for
    assert docker_words('DEFAULT = "docker"\nenv = "DOCKER_HOST"\n') == []
    found = {}
    for path in sorted((REPO / "orchestrator").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith(DOCKER_PLACES):
            continue
        words = [
            w
            for w in docker_words(path.read_text())
            if (w.partition(": ")[2] or w) not in DOCKER_ALLOWED.get(relative, set())
        ]
        if words:
            found[relative] = words
    assert not found, f"Docker vocabulary in backend-neutral code: {found}"


def test_the_wheelhouse_and_e2b_need_no_docker_sdk() -> None:
    """Resolving wheels (and the E2B backend, which uses it) must not need the Docker SDK."""
    code = (
        "import sys; import orchestrator.images.wheelhouse, orchestrator.backends.e2b; "
        "assert 'docker' not in sys.modules, 'docker imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


#: What every backend must implement (docs/ARCHITECTURE.md, "Adding a backend"); the rest of
#: `Backend` has defaults, and pooling and image storage are optional parts of their own.
REQUIRED_BACKEND_MEMBERS = {"prepare_image", "create", "list_sandboxes", "remove_sandbox"}


def test_backend_requires_at_most_six_members() -> None:
    from orchestrator.backends.base import Backend, ImageStore, WarmSandboxes

    required = set(Backend.__abstractmethods__)
    assert required == REQUIRED_BACKEND_MEMBERS, sorted(required)
    assert len(required) <= 6
    # the optional parts add theirs only to a backend that derives from them
    assert WarmSandboxes.__abstractmethods__ - required == {"create_idle"}
    assert ImageStore.__abstractmethods__ - required == {
        "list_images",
        "prune_images",
        "bootstrap_base",
    }


#: Folders of tests/ that hold suites across modules, not the tests of one sub-package
#: (tests/README.md), and where orchestrator_runtime's tests live.
TEST_SUITES = frozenset({"security", "faults", "examples", "project", "e2b_server"})
RUNTIME_TESTS = "runtime"


def misplaced_tests(tests: Path) -> list[str]:
    """Test modules under `tests` whose place mirrors no code: tests/test_<module>.py needs
    orchestrator/<module>.py; tests/<sub-package>/... needs orchestrator/<sub-package>/
    (tests/runtime/ stands for orchestrator_runtime/), unless the folder is a suite."""
    misplaced = []
    for path in sorted(tests.rglob("test_*.py")):
        folder = path.parent.relative_to(tests).parts
        if not folder:
            mirrored = REPO / "orchestrator" / f"{path.stem.removeprefix('test_')}.py"
        elif folder[0] in TEST_SUITES:
            continue
        elif folder[0] == RUNTIME_TESTS:
            mirrored = REPO.joinpath("orchestrator_runtime", *folder[1:])
        else:
            mirrored = REPO.joinpath("orchestrator", *folder)
        if not mirrored.exists():
            misplaced.append(f"{path.relative_to(tests)} (no {mirrored.relative_to(REPO)})")
    return misplaced


def test_tests_mirror_the_code(tmp_path: Path) -> None:
    """A newcomer finds a module's tests by its path (tests/README.md)."""
    misplaced = misplaced_tests(REPO / "tests")
    assert not misplaced, f"move them (tests/README.md): {misplaced}"
    planted = tmp_path / "tests"
    for name in ("test_batch_epochs.py", "batches/test_epochs.py", "batch/test_epochs.py"):
        (planted / name).parent.mkdir(parents=True, exist_ok=True)
        (planted / name).write_text("")
    assert misplaced_tests(planted) == [
        "batches/test_epochs.py (no orchestrator/batches)",
        "test_batch_epochs.py (no orchestrator/batch_epochs.py)",
    ]
