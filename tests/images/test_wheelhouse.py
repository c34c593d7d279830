"""Wheelhouses and requirement lines (no engine needed: pip is faked where it would run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError, ImageBuildError, ManifestError
from orchestrator.images import imagedef, wheelhouse


def test_extra_requirements_refuse_pip_options():
    with pytest.raises(ConfigError):
        imagedef.normalize_requirements(["--index-url https://example.invalid/simple"])
    with pytest.raises(ConfigError):
        imagedef.normalize_requirements(["-r /etc/passwd"])
    assert imagedef.normalize_requirements(["b", "a  >=1", "", "# comment", "b"]) == ("a >=1", "b")


def test_incomplete_wheelhouse_is_resolved_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Only a wheelhouse with its manifest (written last) counts as complete."""
    monkeypatch.setenv(wheelhouse.WHEELHOUSE_ENV, str(tmp_path))
    target = wheelhouse.PythonTarget(version="3.11.2", glibc="2.36", machine="x86_64")
    calls = []

    def fake_pip(command, progress, *, prefix):
        calls.append(command)
        dest = Path(command[command.index("--dest") + 1])
        (dest / "tabulate-0.9.0-py3-none-any.whl").write_bytes(b"wheel")
        (dest / "pip-24.0-py3-none-any.whl").write_bytes(b"pip")
        return imagedef.CommandOutput(0, [])

    monkeypatch.setattr(wheelhouse, "run_streaming", fake_pip)
    first = wheelhouse.ensure_wheelhouse("tabulate\n", target)
    shutil.rmtree(first.path)
    first.path.mkdir()  # as a crash would leave it: files but no manifest
    second = wheelhouse.ensure_wheelhouse("tabulate\n", target)
    assert len(calls) == 2 and second.path == first.path
    assert set(second.wheels) == {"tabulate-0.9.0-py3-none-any.whl", "pip-24.0-py3-none-any.whl"}
    assert second.pins() == "pip==24.0\ntabulate==0.9.0\n"
    third = wheelhouse.ensure_wheelhouse("tabulate\n", target)
    assert len(calls) == 2 and third == second
    command = calls[0]
    assert "--only-binary=:all:" in command and command[command.index("--python-version") + 1]
    assert "manylinux2014_x86_64" in command and "manylinux_2_36_x86_64" in command


def test_damaged_wheelhouse_is_refused(tmp_path: Path):
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"changed")
    house = wheelhouse.Wheelhouse(tmp_path, "k", {"a-1.0-py3-none-any.whl": "0" * 64})
    with pytest.raises(ImageBuildError) as error:
        house.context_files()
    assert "damaged" in error.value.cause and str(tmp_path) in error.value.fix


def test_failed_wheel_resolution_is_an_image_build_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(wheelhouse.WHEELHOUSE_ENV, str(tmp_path))
    target = wheelhouse.PythonTarget(version="3.11.2", glibc="2.36", machine="x86_64")
    monkeypatch.setattr(
        wheelhouse,
        "run_streaming",
        lambda *a, **k: imagedef.CommandOutput(1, ["ERROR: No matching dist"]),
    )
    with pytest.raises(ImageBuildError) as error:
        wheelhouse.ensure_wheelhouse("no-such-package\n", target)
    assert "No matching dist" in error.value.cause and "binary wheels" in error.value.fix
    assert not [p for p in tmp_path.iterdir() if p.suffix != ".lock"]  # nothing half-made


def test_a_requirement_not_on_the_index_is_the_users_mistake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """pip's "No matching distribution" is bad input (exit 2, `python.requirements` named,
    what to do), unless pip could not reach the index: then it is a fault to retry."""
    monkeypatch.setenv(wheelhouse.WHEELHOUSE_ENV, str(tmp_path))
    target = wheelhouse.PythonTarget(version="3.11.2", glibc="2.36", machine="x86_64")
    said = [
        "ERROR: Could not find a version that satisfies the requirement "
        "tabulatr-nonexistent==9.9 (from versions: none)",
        "ERROR: No matching distribution found for tabulatr-nonexistent==9.9",
    ]
    monkeypatch.setattr(
        wheelhouse, "run_streaming", lambda *a, **k: imagedef.CommandOutput(1, said)
    )
    with pytest.raises(ManifestError) as error:
        wheelhouse.ensure_wheelhouse("tabulatr-nonexistent==9.9\n", target)
    assert error.value.exit_code == 2 and error.value.field == "python.requirements"
    assert "'tabulatr-nonexistent==9.9'" in error.value.cause
    assert "pip index versions tabulatr-nonexistent`" in error.value.fix
    offline = [
        "WARNING: Retrying (Retry(total=4)) after connection broken by "
        "'NewConnectionError(...)': /simple/tabulate/",
        *said,
    ]
    monkeypatch.setattr(
        wheelhouse, "run_streaming", lambda *a, **k: imagedef.CommandOutput(1, offline)
    )
    with pytest.raises(ImageBuildError):
        wheelhouse.ensure_wheelhouse("tabulatr-nonexistent==9.9\n", target)
