"""The house rules, checked: layer contracts (import-linter), no private names across modules,
no file over about 500 lines without its reason. docs/ARCHITECTURE.md explains them."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

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
    sandbox = tmp_path / "orchestrator" / "backends" / "docker" / "sandbox.py"
    sandbox.write_text(sandbox.read_text() + "\nfrom ...cli import main  # noqa\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0
    assert "layers: the CLI on top, plain data at the bottom BROKEN" in out.stdout
    assert "orchestrator.backends.docker.sandbox -> orchestrator.cli" in out.stdout


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
