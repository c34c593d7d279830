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

from orchestrator.records.store import Store
from tests.batch.test_session import API_CALLER, MATH, write_jsonl

from ..conftest import REPO, TEST_PAYLOADS, cli, our_containers, wait_for

pytestmark = pytest.mark.docker


def before_first_line(code: int, err: str) -> bool:
    """The signal came before the command installed its handlers (interpreter start-up:
    ~30 ms on an idle machine, several hundred on a loaded one): the process ended by the
    default action (SIGTERM) or as a KeyboardInterrupt during start-up (SIGINT), having
    printed nothing of its own, so nothing existed yet to clean up. Whatever it may have
    made would still show in the checks below (records, containers, networks)."""
    if "orchestrator:" in err:
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
    [("none", 0.1), ("allowlist", 0.1)],
    ids=["none-100ms", "allowlist-100ms"],
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
        if code not in (130, 0) and not before_first_line(code, err)
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


def interrupt_api_at(delay: float, tasks: str, out: str) -> tuple[float, int, str]:
    """Run a batch through the Python API, send SIGINT after `delay` s: (delay, exit, stderr)."""
    payload = str(MATH)
    proc = subprocess.Popen(
        [sys.executable, "-c", API_CALLER, tasks, out, payload],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    return delay, proc.returncode, err


def ended_by_ctrl_c(err: str) -> bool:
    """Its last words are the KeyboardInterrupt, or nothing (Python was still starting)."""
    return not err.strip() or err.rstrip().endswith("KeyboardInterrupt")


def interrupted_starting_python(code: int, err: str) -> bool:
    """The KeyboardInterrupt came while the interpreter was still starting (site's `.pth`
    hooks importing, on a loaded machine up to several hundred ms), before the `-c` program's
    first line: Python exits 1 there, not by SIGINT, and no frame of the program (`<string>`)
    is in the traceback. A `.pth` line that `site` runs shows as `<string>` too, so Python's
    own "Failed to import the site module" settles it. Nothing can have been made; the checks
    below would see it if it had."""
    starting = "init_import_site" in err or 'File "<string>"' not in err
    return code == 1 and ended_by_ctrl_c(err) and starting


def interrupted_importing(code: int, err: str) -> bool:
    """The KeyboardInterrupt came while the program was still importing orchestrator, inside
    the making of a class, where Python 3.11 hands it on wrapped: "Error calling
    __set_name__ ..." (a RuntimeError, exit 1) whose cause is the KeyboardInterrupt. The
    program had called nothing of the API yet, so nothing can have been made; the checks
    below would see it if it had."""
    cause = "KeyboardInterrupt\n\nThe above exception was the direct cause"
    return code == 1 and cause in err and "Error calling __set_name__" in err


def test_ctrl_c_at_any_moment_of_the_python_api_leaves_nothing(
    agent_image: str, docker_client, store_label: str, tmp_path
) -> None:
    """Python's own SIGINT raises KeyboardInterrupt at whatever line runs: once between the
    engine creating the batch's payload-check container and the run holding on to it, which
    left that container behind. `run_batch` (as `run` and `Pool.run`) takes Ctrl-C as a stop
    request at safe points and raises KeyboardInterrupt once all is removed: at every moment
    of a batch's first seconds (start-up, plan, payload check, pool, tasks) the program ends
    by KeyboardInterrupt, or finished, and no container is left."""
    rows = [
        {"id": f"s{i}", "task": "sleep", "additional_args": {"op": "sleep", "seconds": 2}}
        for i in range(3)
    ]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", rows)
    # 0 to 3.3 s, over start-up, plan, payload check, pool and tasks: where in them each
    # moment lands moves by more than the 0.3 s between moments with Python's start-up time
    steps = [round(i * 0.3, 2) for i in range(12)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        outcomes = list(
            pool.map(
                lambda i: interrupt_api_at(steps[i], str(tasks), str(tmp_path / f"out{i}")),
                range(len(steps)),
            )
        )
    # A program that a KeyboardInterrupt ended is ended by SIGINT again (-2), as is one still
    # starting Python (nothing made yet), or exits 1 from Python's own start-up; 0: it
    # finished first.
    problems = [
        (delay, code, err.strip().splitlines()[-3:])
        for delay, code, err in outcomes
        if code != 0
        and not (code == -signal.SIGINT and ended_by_ctrl_c(err))
        and not interrupted_starting_python(code, err)
        and not interrupted_importing(code, err)
    ]
    assert not problems, problems
    left = our_containers(docker_client, store_label)
    for container in left:  # removed so that one failure does not cascade
        docker_client.api.remove_container(container["Id"], force=True)
    assert not left, [c["Names"] for c in left]
