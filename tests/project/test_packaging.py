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

from tests.conftest import REPO

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        # sdist, then the wheel from it: the route pip and `python -m build` take
        [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    metadata = (
        zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        .decode()
    )
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
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"  # no checkout here: everything comes from the wheel
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run(
        [str(venv / "bin" / "orchestrator"), "run", "research_team", "--json"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["status"] == "succeeded" and str(result["answer"]) == "48"
    # The same definition, wherever its files live: the checkout's image is reused.
    assert result["image"] == agent_image
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import orchestrator; print(orchestrator.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert str(venv) in where.stdout and str(REPO) not in where.stdout


def quick_start_lines() -> list[str]:
    """The commands of the README's quick start block, as a new user copies them."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_quick_start_works_in_a_fresh_shell_as_written() -> None:
    """Every bare `orchestrator` of the quick start comes after the line that puts it on
    PATH, and that line does so in a shell that has nothing of ours on its PATH."""
    lines = quick_start_lines()
    first_bare = next(i for i, line in enumerate(lines) if line.startswith("orchestrator "))
    activate = next(i for i, line in enumerate(lines) if line.startswith("source "))
    assert activate < first_bare, lines
    shell = subprocess.run(
        ["bash", "-c", f"{lines[activate]} && orchestrator --version"],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shell.returncode == 0 and "orchestrator" in shell.stdout, shell.stderr


def test_the_quick_start_says_its_scripted_error_is_part_of_the_example() -> None:
    """The quick start's first screen shows an InterpreterError (the example's scripted
    librarian recovers from it): the script and the README say so."""
    manifest = (REPO / "agent_payloads" / "research_team" / "manifest.toml").read_text()
    assert 'tower["year"]' in manifest and 'tower["opened"]' in manifest  # the scripted slip
    script = (REPO / "scripts" / "quickstart.sh").read_text()
    assert "InterpreterError above is part of the example" in script
    readme = (REPO / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "The `InterpreterError` among them is part of the example" in quick_start


def test_the_editable_install_of_the_setup_prints_no_warning_wall() -> None:
    """scripts/setup.sh's editable installs name the setuptools warning they silence; with
    that filter pip prints nothing (the same install without it prints the wall)."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    (quiet,) = [
        line.split("=", 1)[1].strip('"')
        for line in setup.splitlines()
        if line.startswith("quiet_build=")
    ]
    assert setup.count("PYTHONWARNINGS=$quiet_build") == 2  # both editable installs
    plugin = REPO / "tests" / "plugins" / "orchestrator_mirror"
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--disable-pip-version-check",
        "-e",
        str(plugin),
    ]
    installed = subprocess.run(
        command,
        env={**os.environ, "PYTHONWARNINGS": quiet},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    assert "Warning" not in installed.stdout + installed.stderr, installed.stderr


def test_the_setup_says_each_long_step_before_it_starts(tmp_path: Path) -> None:
    """The quick start's set-up ran pip and uv quietly for about 110 s
    without a word. Each quiet install is announced first. The script runs for real, in a
    copy of the checkout whose .venv tools only log their calls (a real install takes
    minutes and would replace the .venv these tests run from)."""
    import shutil
    import stat

    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    tool = '#!/bin/sh\necho "ran: $(basename "$0") $*" >&2\n'
    stubs = (".venv/bin/python", ".venv/bin/uv", ".venv-phoenix/bin/python")
    for path in (*stubs, ".venv-mitmproxy/bin/python", "bin/debootstrap"):
        stub = tmp_path / path
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text(tool)
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    done = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup.sh")],
        env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    def first_call(*words: str) -> int:
        return next(
            i
            for i, line in enumerate(lines)
            if line.startswith("ran:") and all(w in line for w in words)
        )

    assert first("setup: installing orchestrator") < first("ran: python -m pip"), lines
    assert first("setup: installing Arize Phoenix") < first_call("pip install", ".venv-phoenix/"), (
        lines
    )
    mitmproxy = next(i for i, line in enumerate(lines) if "images/interceptor/" in line)
    assert first("setup: installing mitmproxy") < mitmproxy, lines
    said = [line for line in lines if line.startswith("setup: ")]
    assert len(said) >= 3 and said[-1].startswith("setup: ready"), lines
