"""A run whose record cannot be written (its state directory's disk is full) ends
`infra_error` with one clear message and exit 5, with nothing left running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.labels import LABEL_STORE, store_id

from ..conftest import REPO, TEST_PAYLOADS

pytestmark = pytest.mark.docker


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 3 MiB tmpfs (CI runs as root; if mounting fails the test fails, it never skips)."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_under_the_run_record_ends_the_run_cleanly(
    small_disk: Path, agent_image: str, docker_client
) -> None:
    home = small_disk / "home"
    env = {**os.environ, "ORCHESTRATOR_HOME": str(home)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "run",
            str(TEST_PAYLOADS / "adversary"),
            "--arg",
            'mode="flood"',
            "--timeout",
            "60",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 5, out.stderr
    assert "Traceback" not in out.stderr
    assert "record_unwritable" in out.stderr and "No space left on device" in out.stderr
    label = f"{LABEL_STORE}={store_id(home)}"
    assert not docker_client.api.containers(all=True, filters={"label": [label]})
