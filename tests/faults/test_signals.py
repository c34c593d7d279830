"""Signals at any moment: SIGINT or SIGTERM at every instant of a run's first seconds ends it
`cancelled` with exit 130 (or 0 if it had finished), never as an engine error, and leaves no
container and no network."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from orchestrator.store import Store

from ..conftest import REPO, TEST_PAYLOADS, cli, our_containers, wait_for

pytestmark = pytest.mark.docker

#: Until Python has run the command's first line (interpreter start-up, ~30 ms on an idle
#: machine, over 100 ms on a loaded one), a signal ends the process by its default action
#: (SIGTERM) or as a KeyboardInterrupt during start-up (SIGINT): nothing exists yet to clean up.
BEFORE_FIRST_LINE = 0.2


def before_first_line(delay: float, code: int, err: str) -> bool:
    """The signal came before the command's handlers were installed (see above)."""
    if delay > BEFORE_FIRST_LINE:
        return False
    interrupted = code == 1 and err.strip().endswith("KeyboardInterrupt")
    return code in (-signal.SIGINT, -signal.SIGTERM) or interrupted


def signal_at(delay: float, sig: signal.Signals, *args: str) -> tuple[float, int, str]:
    """Start `orchestrator run`, send `sig` after `delay` seconds; (delay, exit, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "run", *args, "--quiet"],
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    return delay, proc.returncode, err


def sweep(args: list[str], steps: list[float]) -> list[tuple[float, int, str]]:
    signals = [signal.SIGINT, signal.SIGTERM]
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [
            pool.submit(signal_at, delay, signals[i % 2], *args) for i, delay in enumerate(steps)
        ]
        return [f.result() for f in futures]


@pytest.mark.parametrize(
    ("network", "step"),
    [("none", 0.05), ("allowlist", 0.1)],
    ids=["none-50ms", "allowlist-100ms"],
)
def test_a_signal_at_any_moment_cancels_cleanly(
    agent_image: str, docker_client, store_label: str, network: str, step: float
) -> None:
    args = [str(TEST_PAYLOADS / "sleeper"), "--arg", "seconds=2", "--network", network]
    if network == "allowlist":
        args += ["--allow-host", "example.com"]
    started = time.time()
    steps = [round(i * step, 2) for i in range(int(3 / step) + 1)]
    outcomes = sweep(args, steps)
    problems = [
        (delay, code, err.strip().splitlines()[-3:])
        for delay, code, err in outcomes
        if code not in (130, 0) and not before_first_line(delay, code, err)
    ]
    assert not problems, problems
    assert not any("engine" in err.lower() for _, _, err in outcomes)
    assert sum(code == 130 for _, code, _ in outcomes) >= len(steps) // 2
    runs = [r for r in Store().list_runs(limit=10_000) if r["created_at"] >= started]
    assert runs and all(r["status"] in ("cancelled", "succeeded") for r in runs), [
        (r["run_id"], r["status"], r["error"]) for r in runs if r["status"] != "cancelled"
    ]
    wait_for(lambda: not our_containers(docker_client, store_label), timeout=10)
    networks = docker_client.api.networks(filters={"label": [store_label]})
    assert not networks, [n["Name"] for n in networks]
    assert "closed run" not in cli("runs", "list").stderr  # nothing was orphaned
