"""Inputs checked before anything starts, through the real CLI.

One test per class of bad input: each must exit 2 with the file and the place (field, line)
named, print no traceback, and create no container (Docker's own event log is asked, so a
container created and removed again still counts).
"""

from __future__ import annotations

import json
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from ..conftest import cli, write_payload

MANIFEST = """
[payload]
name = "inputs"
entrypoint = "agent:build"
example_task = "hi"
"""


def refused(result: CompletedProcess, *places: str) -> str:
    """Exit 2, an `error:` paragraph naming every one of `places`, no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    assert result.stderr.startswith("orchestrator: error: "), output
    for place in places:
        assert place in result.stderr, (place, result.stderr)
    return result.stderr


def payload(tmp_path: Path, extra: str = "", manifest: str = MANIFEST) -> Path:
    folder = tmp_path / "payload"
    folder.mkdir()
    return write_payload(folder, manifest + extra)


def command(kind: str, folder: Path, *more: str) -> CompletedProcess:
    if kind == "validate":
        return cli("validate", str(folder), *more)
    return cli("run", str(folder), "--model", "mock", *more)


BOTH = pytest.mark.parametrize("kind", ["validate", "run"])


# ---- requirements: package specifications only ------------------------------------------------


@BOTH
@pytest.mark.parametrize(
    "requirement",
    ["x @ file:///etc/passwd", "https://example.com/x-1.0-py3-none-any.whl", "./vendor/x"],
)
@pytest.mark.docker
def test_requirement_that_is_not_a_package_spec_is_refused(
    tmp_path: Path, kind: str, requirement: str, nothing_starts: None
) -> None:
    folder = payload(tmp_path, f"\n[python]\nrequirements = {json.dumps([requirement])}\n")
    message = refused(
        command(kind, folder), str(folder / "manifest.toml"), "python.requirements", requirement
    )
    assert "--allow-requirement" in message


@pytest.mark.docker
def test_allowed_requirement_passes_the_check_by_name(tmp_path: Path, nothing_starts) -> None:
    """With --allow-requirement naming it, the reference passes: the run gets as far as the
    next check (a missing secret here), so still nothing starts."""
    reference = "x @ file:///nonexistent/x-1.0.tar.gz"
    extra = (
        f"\n[python]\nrequirements = {json.dumps([reference])}\n"
        '\n[secrets]\nrequired = ["ORCH_SECURITY_INPUTS_UNSET"]\n'
    )
    folder = payload(tmp_path, extra)
    refused(command("run", folder), "python.requirements")
    allowed = command("run", folder, "--allow-requirement", reference, "--env-file", "/dev/null")
    message = refused(allowed, "ORCH_SECURITY_INPUTS_UNSET")
    assert "python.requirements" not in message


# ---- hosts: DNS names only ----------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "[::1]", "localhost", "1234"])
@pytest.mark.docker
def test_payload_host_that_is_not_a_dns_name_is_refused(
    tmp_path: Path, kind: str, host: str, nothing_starts: None
) -> None:
    folder = payload(tmp_path, f'\n[network]\nhosts = ["{host}"]\n')
    message = refused(command(kind, folder), str(folder / "manifest.toml"), "network.hosts", host)
    assert "--api-base" in message


@pytest.mark.docker
def test_allow_host_that_is_not_a_dns_name_is_refused(tmp_path: Path, nothing_starts) -> None:
    folder = payload(tmp_path)
    for host in ("127.0.0.1", "::1", "localhost"):
        message = refused(command("run", folder, "--allow-host", host), "--allow-host", host)
        assert "--api-base" in message


@pytest.mark.docker
def test_schedule_host_that_is_not_a_dns_name_is_refused(tmp_path: Path, nothing_starts) -> None:
    folder = payload(tmp_path)
    schedules = tmp_path / "schedules.toml"
    schedules.write_text(
        f'[[schedule]]\nname = "nightly"\ncron = "@daily"\npayload = "{folder}"\n'
        'allow_hosts = ["0.0.0.0"]\n'
    )
    message = refused(
        cli("schedule", "validate", "--file", str(schedules)),
        str(schedules),
        'schedule "nightly" field `allow_hosts`',
        "0.0.0.0",
    )
    assert "api_base" in message


# ---- files that are not UTF-8 ------------------------------------------------------------------


@BOTH
@pytest.mark.docker
def test_manifest_that_is_not_utf8_is_refused(tmp_path: Path, kind: str, nothing_starts) -> None:
    folder = payload(tmp_path)
    (folder / "manifest.toml").write_bytes(MANIFEST.encode().replace(b'"hi"', b'"h\xe9"'))
    refused(command(kind, folder), f"{folder / 'manifest.toml'}: line 5, column 18", "UTF-8")


@pytest.mark.docker
def test_tasks_jsonl_line_that_is_not_utf8_is_refused(tmp_path: Path, nothing_starts) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'{"task": "one"}\n{"task": "caf\xe9"}\n{"task": "three"}\n')
    result = cli("batch", str(payload(tmp_path)), str(tasks), "-o", str(tmp_path / "out"))
    refused(result, f"{tasks}:2: byte 0xe9 at column 14", "--on-bad-line skip")


@pytest.mark.docker
def test_tasks_csv_row_that_is_not_utf8_is_refused(tmp_path: Path, nothing_starts) -> None:
    tasks = tmp_path / "tasks.csv"
    tasks.write_bytes(b'id,task\na,one\nb,"caf\xe9\nau lait"\nc,three\n')
    result = cli("batch", str(payload(tmp_path)), str(tasks), "-o", str(tmp_path / "out"))
    refused(result, f"{tasks}:3: column `task`", "UTF-8")


@pytest.mark.docker
def test_schedules_file_that_is_not_utf8_is_refused(tmp_path: Path, nothing_starts) -> None:
    schedules = tmp_path / "schedules.toml"
    schedules.write_bytes(b'[[schedule]]\nname = "caf\xe9"\ncron = "@daily"\n')
    refused(cli("schedule", "validate", "--file", str(schedules)), str(schedules), "line 2")


@pytest.mark.docker
def test_env_file_that_is_not_utf8_is_refused(tmp_path: Path, nothing_starts) -> None:
    folder = payload(tmp_path, '\n[secrets]\nrequired = ["ORCH_SECURITY_INPUTS_UNSET"]\n')
    env_file = tmp_path / "custom.env"
    env_file.write_bytes(b"# secrets\nORCH_SECURITY_INPUTS_UNSET=caf\xe9\n")
    result = command("run", folder, "--env-file", str(env_file))
    refused(result, f"{env_file}: line 2, column 31", "UTF-8")


# ---- a JSONL line that is not UTF-8 is a bad line like any other -------------------------------


def test_undecodable_jsonl_line_is_skipped_with_on_bad_line_skip(tmp_path: Path) -> None:
    from orchestrator.batch.tasks import read_tasks

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'{"task": "one"}\n{"task": "caf\xe9"}\n{not json\n{"task": "four"}\n')
    file = read_tasks(tasks, on_bad_line="skip")
    assert [t.task for t in file.tasks] == ["one", "four"]
    assert [(b.line, b.message.split(" (")[0]) for b in file.bad_lines] == [
        (2, "byte 0xe9 at column 14 is not valid UTF-8"),
        (3, "not valid JSON"),
    ]
