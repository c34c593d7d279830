"""The package a user installs with pip: `python -m build` makes a wheel that carries the
image definitions, the runtime and the examples; installed in a fresh virtualenv outside the
checkout, `orchestrator run <shipped example>` runs to its answer with the mock model.

The fresh virtualenv gets its dependencies from the package index (pip's usual sources).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        # sdist, then the wheel from it: the route pip and `python -m build` take
        [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (path,) = out.glob("orchestrator-*.whl")
    return path


def test_wheel_carries_images_runtime_and_examples(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "orchestrator/share/images/agent/Dockerfile",
        "orchestrator/share/images/agent/requirements.txt",
        "orchestrator/share/images/egress/Dockerfile",
        "orchestrator/share/agent_payloads/research_team/manifest.toml",
        "orchestrator/share/agent_payloads/research_team/data/landmarks.json",
        "orchestrator_runtime/__main__.py",
        "orchestrator/cli/__init__.py",
        "orchestrator/backends/docker/seccomp.json",
        "orchestrator/backends/docker/setup-gvisor.sh",
    ):
        assert required in names, required
    assert not [n for n in names if "__pycache__" in n or n.startswith("tests/")]
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))
    ).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    host = [line for line in requires if "extra ==" not in line]
    assert host and not [line for line in host if "smolagents" in line], host


def test_installed_wheel_runs_a_shipped_example(
    wheel: Path, tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"  # no checkout here: everything comes from the wheel
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run(
        [str(venv / "bin" / "orchestrator"), "run", "research_team", "--json"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["status"] == "succeeded" and str(result["answer"]) == "48"
    # The same definition, wherever its files live: the checkout's image is reused.
    assert result["image"] == agent_image
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import orchestrator; print(orchestrator.__file__)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert str(venv) in where.stdout and str(REPO) not in where.stdout
