"""Bounded output: one endless line from the sandbox costs the host bounded memory and linear
time; the run ends normally and its record says what was cut."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.records.record import MAX_LINE_BYTES

from ..conftest import REPO, TEST_PAYLOADS

pytestmark = pytest.mark.docker

MEASURE = (
    "import json, resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "print(json.dumps({'rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,"
    " 'exit': done.returncode, 'stdout': done.stdout, 'stderr': done.stderr}))\n"
)


def test_a_50_mib_line_is_cut_with_bounded_host_memory(agent_image: str, no_leftovers) -> None:
    command = [
        sys.executable,
        "-m",
        "orchestrator",
        "run",
        str(TEST_PAYLOADS / "adversary"),
        "--arg",
        'mode="longline-50"',
        "--memory",
        "512",
        "--json",
        "--quiet",
    ]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *command],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    measured = json.loads(out.stdout)
    assert measured["exit"] == 0, measured["stderr"]
    assert measured["rss_mb"] < 100, measured["rss_mb"]
    result = json.loads(measured["stdout"])
    assert result["status"] == "succeeded" and result["answer"] == "printed"
    record = Path(result["record_dir"])
    cuts = [
        json.loads(line)
        for line in (record / "events.jsonl").open()
        if json.loads(line)["type"] == "output_cut"
    ]
    assert len(cuts) == 1 and cuts[0]["stream"] == "stderr", cuts
    assert cuts[0]["kept_bytes"] == MAX_LINE_BYTES
    assert cuts[0]["dropped_bytes"] == 50 * 2**20 - MAX_LINE_BYTES
    log = (record / "stderr.log").read_text()
    assert "was cut at" in log and len(log) < 2 * MAX_LINE_BYTES


@pytest.mark.gvisor
def test_one_large_write_reaches_the_record_whole(agent_image: str, no_leftovers) -> None:
    """One 512 KiB write to stderr arrives whole, on either kernel: under gVisor a write to
    the container's stderr pipe takes at most 64 KiB, and an unbuffered sys.stderr took the
    short write as done (the rest was lost, silently)."""
    from orchestrator import RunSpec, run

    result = run(
        RunSpec(payload=TEST_PAYLOADS / "adversary", additional_args={"mode": "block-512"})
    )
    assert result.status == "succeeded" and result.answer == "written", result.error
    lines = (Path(result.record_dir) / "stderr.log").read_text().splitlines()
    assert "z" * (512 * 1024) in lines, [len(line) for line in lines if line.startswith("zz")]
