"""Payload shipping: only regular files inside the payload folder reach the sandbox,
byte-exact; links out of it, FIFOs and oversized inputs are refused before anything starts."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ..conftest import cli, our_containers, write_payload

pytestmark = pytest.mark.docker

MANIFEST = """
[payload]
name = "shipping"
entrypoint = "agent:build"
example_task = "Report the files."

[mock.scripts]
manager = [\"\"\"Thought: report.
<code>
final_answer(digests())
</code>\"\"\"]
"""

AGENT = '''
import hashlib
from pathlib import Path

from smolagents import CodeAgent, tool

HERE = Path(__file__).parent


@tool
def digests() -> str:
    """The sha256 of every data file shipped with this payload."""
    return " ".join(
        f"{p.name}={hashlib.sha256(p.read_bytes()).hexdigest()}"
        for p in sorted((HERE / "data").iterdir())
    )


def build(model):
    return CodeAgent(tools=[digests], model=model, max_steps=1)
'''

PNG = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489")
LATIN1_CSV = "name,city\nJosé,Málaga\nZoë,Köln\n".encode("latin-1")


def payload(tmp_path: Path) -> Path:
    (tmp_path / "payload").mkdir()
    folder = write_payload(tmp_path / "payload", MANIFEST, AGENT)
    (folder / "data").mkdir()
    (folder / "data" / "logo.png").write_bytes(PNG)
    (folder / "data" / "cities.csv").write_bytes(LATIN1_CSV)
    return folder


def refused(folder: Path, docker_client, store_label: str, *args: str) -> str:
    out = cli("run", str(folder), *args, "--quiet")
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert not our_containers(docker_client, store_label)
    validated = cli("validate", str(folder))
    assert validated.returncode == 2, validated.stdout
    return out.stderr


def test_binary_files_arrive_byte_exact(tmp_path: Path, agent_image: str, no_leftovers) -> None:
    folder = payload(tmp_path)
    out = cli("run", str(folder), "--json", "--quiet")
    assert out.returncode == 0, out.stderr
    expected = " ".join(
        f"{name}={hashlib.sha256(data).hexdigest()}"
        for name, data in sorted({"cities.csv": LATIN1_CSV, "logo.png": PNG}.items())
    )
    assert json.loads(out.stdout)["answer"] == expected


def test_a_symlink_to_a_host_file_is_refused(
    tmp_path: Path, docker_client, store_label: str
) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("not for the sandbox")
    folder = payload(tmp_path)
    (folder / "data" / "notes.txt").symlink_to(secret)
    err = refused(folder, docker_client, store_label)
    assert "notes.txt" in err and "leaves the payload folder" in err


def test_a_symlinked_folder_and_a_fifo_are_refused(
    tmp_path: Path, docker_client, store_label: str
) -> None:
    folder = payload(tmp_path)
    (folder / "etc").symlink_to("/etc")
    assert "symlinked folder" in refused(folder, docker_client, store_label)
    (folder / "etc").unlink()
    os.mkfifo(folder / "data" / "pipe")
    err = refused(folder, docker_client, store_label)
    assert "pipe" in err and "FIFO" in err


def test_limits_on_files_bytes_and_task_are_named(
    tmp_path: Path, docker_client, store_label: str
) -> None:
    folder = payload(tmp_path)
    # (the default task limit is 1024 KiB, more than a command line holds: lower it)
    out = cli("run", str(folder), "x" * 3000, env={"ORCHESTRATOR_MAX_TASK_KB": "2"})
    assert out.returncode == 2 and not our_containers(docker_client, store_label)
    assert "over the limit of 2 KiB" in out.stderr and "ORCHESTRATOR_MAX_TASK_KB" in out.stderr
    for i in range(500):
        (folder / "data" / f"f{i}.txt").write_text("x")
    err = refused(folder, docker_client, store_label)
    assert "more than 500 files" in err and "ORCHESTRATOR_MAX_PAYLOAD_FILES" in err
