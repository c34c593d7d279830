"""Ctrl-C in the Python API (`interrupts.py`): a stop request honoured at safe points, then
KeyboardInterrupt; the mechanism alone, then `run` and `run_batch` with SIGINT arriving the
instant the engine has made a container (where Python's own KeyboardInterrupt leaked it)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.base import Sandbox, SandboxSpec
from orchestrator.backends.docker import DockerBackend
from orchestrator.batch import BatchSpec, run_batch
from orchestrator.lifecycle.interrupts import stop_on_interrupt
from orchestrator.lifecycle.runner import run
from orchestrator.records.store import Store
from orchestrator.spec import RunSpec
from tests.batch.test_session import MATH, write_jsonl
from tests.conftest import TEST_PAYLOADS, our_containers


def ctrl_c() -> None:
    """SIGINT to this process, as a terminal's Ctrl-C: Python runs the handler right after."""
    os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_sets_the_event_lets_the_work_finish_then_raises() -> None:
    cancel = threading.Event()
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with stop_on_interrupt(cancel):
            ctrl_c()
            steps.append("went on")  # not cut off at this line
            assert cancel.is_set()
            steps.append("cleaned up")
    assert steps == ["went on", "cleaned up"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_raises_at_once() -> None:
    cancel = threading.Event()
    with pytest.raises(KeyboardInterrupt):
        with stop_on_interrupt(cancel):
            ctrl_c()
            ctrl_c()
            pytest.fail("the second Ctrl-C did not interrupt")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_ctrl_c_nothing_changes() -> None:
    cancel = threading.Event()
    with stop_on_interrupt(cancel):
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert not cancel.is_set()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_callers_own_handler_and_other_threads_are_left_alone() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: seen.append(signum))
    try:
        cancel = threading.Event()
        with stop_on_interrupt(cancel):
            ctrl_c()
        assert seen == [signal.SIGINT] and not cancel.is_set()
    finally:
        signal.signal(signal.SIGINT, previous)
    box: dict[str, Any] = {}

    def elsewhere() -> None:
        with stop_on_interrupt(threading.Event()):
            box["handler"] = signal.getsignal(signal.SIGINT)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert box["handler"] is signal.default_int_handler


class CtrlCAfterCreate(DockerBackend):
    """Ctrl-C the moment the engine has made a run's container, before the caller holds it:
    Python's own KeyboardInterrupt, raised here, left the container behind."""

    def create(self, spec: SandboxSpec, progress: Any) -> Sandbox:
        sandbox = super().create(spec, progress)
        ctrl_c()
        return sandbox


@pytest.mark.docker
def test_ctrl_c_as_runs_container_is_made_removes_it_and_raises(
    agent_image: str, docker_client, store_label: str, no_leftovers
) -> None:
    before = {r["run_id"] for r in Store().list_runs(limit=1000)}
    spec = RunSpec(payload=TEST_PAYLOADS / "sleeper", additional_args={"seconds": 30})
    with pytest.raises(KeyboardInterrupt):
        run(spec, backend=CtrlCAfterCreate(docker_client))
    assert our_containers(docker_client, store_label) == []
    (new,) = [r for r in Store().list_runs(limit=1000) if r["run_id"] not in before]
    assert new["status"] == "cancelled"


@pytest.mark.docker
def test_ctrl_c_as_a_batchs_first_container_is_made_removes_it_and_raises(
    tmp_path: Path, agent_image: str, docker_client, store_label: str, no_leftovers
) -> None:
    """The first container is the payload check's: the batch then starts no task."""
    rows = [
        {"id": f"s{i}", "task": "sleep", "additional_args": {"op": "sleep", "seconds": 30}}
        for i in range(3)
    ]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", rows)
    spec = BatchSpec(tasks=tasks, output=tmp_path / "out", run=RunSpec(payload=MATH))
    with pytest.raises(KeyboardInterrupt):
        run_batch(spec, backend=CtrlCAfterCreate(docker_client))
    assert our_containers(docker_client, store_label) == []
    assert (
        not (tmp_path / "out" / "results.jsonl").is_file()
        or not (tmp_path / "out" / "results.jsonl").read_text()
    )
