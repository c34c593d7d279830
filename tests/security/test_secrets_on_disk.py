"""Secrets stay off the host's disk: a secret a tool prints is in no engine-side log of the
sandbox (`docker logs`, the engine's data directory), during a run and after its orchestrator
was SIGKILLed; in the run record it is masked."""

from __future__ import annotations

import json
import os
import signal
import urllib.parse
from pathlib import Path

import docker.errors
import pytest

from orchestrator.labels import LABEL_RUN_ID

from ..conftest import (
    cli,
    files_holding,
    our_containers,
    running_sandboxes,
    start_cli,
    wait_for,
    write_payload,
)

pytestmark = pytest.mark.docker

SECRET = "hunter2 Very/Secret+7c1f9a?"  # characters that percent-encoding changes
ENGINE_CONTAINERS = Path("/var/lib/docker/containers")

MANIFEST = """
[payload]
name = "printer"
entrypoint = "agent:build"
example_task = "Print the secret."

[secrets]
required = ["PRINTED_SECRET"]

[mock.scripts]
manager = [\"\"\"Thought: print it, then wait.
<code>
final_answer(shout())
</code>\"\"\"]
"""

AGENT = '''
import os, sys, time, urllib.parse

from smolagents import CodeAgent, tool


@tool
def shout() -> str:
    """Print the secret every way, then wait a while."""
    secret = os.environ["PRINTED_SECRET"]
    for text in (secret, secret.encode().hex(), secret.encode().hex().upper(),
                 urllib.parse.quote(secret)):
        print("stdout:", text, flush=True)
        print("stderr:", text, file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("SHOUT_WAIT", "8")))
    return "done"


def build(model):
    return CodeAgent(tools=[shout], model=model, max_steps=1)
'''


@pytest.mark.parametrize("ending", ["normal", "orchestrator_killed"])
def test_a_printed_secret_reaches_no_engine_log(
    ending: str,
    tmp_path: Path,
    agent_image: str,
    docker_client,
    store_label: str,
    orchestrator_home: Path,
) -> None:
    assert ENGINE_CONTAINERS.is_dir(), "this test reads the engine's data directory (root)"
    folder = tmp_path / "printer"
    folder.mkdir()
    write_payload(folder, MANIFEST, AGENT)
    proc = start_cli(
        "run", str(folder), "--json", "--quiet", env={**os.environ, "PRINTED_SECRET": SECRET}
    )
    sandbox = wait_for(lambda: running_sandboxes(docker_client, store_label), timeout=180)[0]
    stderr = orchestrator_home / "runs" / sandbox["Labels"][LABEL_RUN_ID] / "stderr.log"

    def printed() -> bool:  # all four forms, the last on stderr (the record has them masked)
        text = stderr.read_text() if stderr.is_file() else ""  # not the store's database
        return text.count("stderr: ") >= 4

    wait_for(printed, timeout=120)
    assert not files_holding(SECRET, ENGINE_CONTAINERS)
    with pytest.raises(docker.errors.APIError, match="logging driver"):  # no log at all
        docker_client.api.logs(sandbox["Id"])
    if ending == "orchestrator_killed":
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        assert not files_holding(SECRET, ENGINE_CONTAINERS)
        cli("runs", "list")  # closes the orphaned run, removes the container
        assert not our_containers(docker_client, store_label)
        return
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert not files_holding(SECRET, ENGINE_CONTAINERS)
    record = Path(json.loads(out)["record_dir"])
    forms = {
        "plain": SECRET,
        "hex": SECRET.encode().hex(),
        "HEX": SECRET.encode().hex().upper(),
        "percent": urllib.parse.quote(SECRET),
    }
    assert len(set(forms.values())) == len(forms)  # four different strings to look for
    for name in ("events.jsonl", "stderr.log", "stdout.log", "result.json"):
        text = (record / name).read_text()
        assert not [form for form, value in forms.items() if value in text], name
    assert "***" in (record / "stderr.log").read_text()
