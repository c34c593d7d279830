"""A batch's warm pool makes a sandbox only for an attempt that will take it: counted
from the creations the Docker engine saw, not from what the pool says of itself."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator import Pool
from orchestrator.backends.base import Sandbox, SandboxSpec
from orchestrator.backends.docker import DockerBackend
from orchestrator.batch import BatchSpec, run_batch
from orchestrator.execution import pool as pool_module
from orchestrator.execution.executor import LocalExecutor
from orchestrator.execution.pool import MAX_SIZE, MIN_BUILDERS
from orchestrator.labels import LABEL_KIND, LABEL_RUN_ID, LABEL_WARM
from orchestrator.lifecycle.runner import prepare, sandbox_spec
from orchestrator.spec import RunResult, RunSpec
from tests.batch.test_session import MATH, math_rows, write_jsonl
from tests.conftest import wait_for

pytestmark = pytest.mark.docker


def sandbox_creations(docker_client, store_label: str, since: float) -> list[dict[str, Any]]:
    """The sandboxes of this test session the engine created from `since` to now, in order:
    each one's run id, whether it was warm, and when (engine event time, epoch seconds)."""
    events = docker_client.api.events(
        since=f"{since:.9f}",
        until=f"{time.time():.9f}",
        decode=True,
        filters={
            "type": "container",
            "event": "create",
            "label": [store_label, f"{LABEL_KIND}=sandbox"],
        },
    )
    return [
        {
            "run_id": event["Actor"]["Attributes"][LABEL_RUN_ID],
            "warm": event["Actor"]["Attributes"].get(LABEL_WARM) == "true",
            "at": event["timeNano"] / 1e9,
        }
        for event in events
    ]


def test_a_batch_pool_makes_one_sandbox_per_attempt_and_none_past_the_last(
    tmp_path: Path, agent_image: str, docker_client, store_label: str, no_leftovers
) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(6))
    spec = BatchSpec(
        tasks=tasks, output=tmp_path / "out", run=RunSpec(payload=MATH), concurrency=2, warm=2
    )
    since = time.time()
    summary = run_batch(spec)
    created = sandbox_creations(docker_client, store_label, since)

    assert summary.counts["succeeded"] == 6 and summary.correct == 6, summary.counts
    lines = (tmp_path / "out" / "attempts.jsonl").read_text().splitlines()
    starts = [row for row in map(json.loads, lines) if row["event"] == "start"]
    attempts = [row["run_id"] for row in starts]
    assert len(attempts) == 6
    # The first sandbox is the payload's load check, made before the batch's pool exists.
    check, created = created[0], created[1:]
    assert not check["warm"] and check["run_id"] not in attempts
    made = [c["run_id"] for c in created]
    assert sorted(made) == sorted(attempts), (
        f"{len(made)} sandboxes for {len(attempts)} attempts; "
        f"made for no attempt: {sorted(set(made) - set(attempts))}"
    )
    assert any(c["warm"] for c in created), "the pool made no sandbox at all"
    last_handed_out = max(row["ts"] for row in starts)
    late = [c for c in created if c["warm"] and c["at"] > last_handed_out]
    assert late == [], f"warm sandboxes made after the last attempt was handed out: {late}"
    assert no_leftovers() == [], "a sandbox was left when the batch ended"


def test_at_concurrency_one_the_pool_keeps_two_sandboxes_coming(
    tmp_path: Path, agent_image: str, docker_client, store_label: str, no_leftovers
) -> None:
    """A warm run is shorter than a sandbox's making: with one sandbox per slot, a batch at
    concurrency 1 waited for each one in turn and ran slower than cold. While attempts are
    handed out, the pool has two sandboxes made and not yet taken (its builders' worth)."""
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(6))
    spec = BatchSpec(
        tasks=tasks, output=tmp_path / "out", run=RunSpec(payload=MATH), concurrency=1, adapt=False
    )
    since = time.time()
    summary = run_batch(spec)
    created = sandbox_creations(docker_client, store_label, since)

    assert summary.counts["succeeded"] == 6, summary.counts
    lines = (tmp_path / "out" / "attempts.jsonl").read_text().splitlines()
    starts = [row for row in map(json.loads, lines) if row["event"] == "start"]
    warm = [c for c in created if c["warm"]]
    taken = {row["run_id"] for row in starts}
    assert len(starts) == 6 and all(c["run_id"] in taken for c in warm), (
        "a warm sandbox was made for no attempt"
    )
    # Made and not yet handed out, after the first hand-out (the start fills both builders).
    first = min(row["ts"] for row in starts)
    moments = sorted([(c["at"], 1) for c in warm] + [(row["ts"], -1) for row in starts])
    pending, most = 0, 0
    for at, step in moments:
        pending += step
        if at > first:
            most = max(most, pending)
    assert most >= 2, f"at most {most} sandbox(es) on their way after the first attempt"
    assert no_leftovers() == [], "a sandbox was left when the batch ended"


def test_on_a_saturated_host_runs_wait_for_the_builders_instead_of_starting_cold(
    agent_image: str, no_leftovers
) -> None:
    """On a full CPU a cold start only competes with the pool's builders for it: a run with
    no sandbox ready waits for the next one made (one builder here, one sandbox at a time),
    and starts cold again once the host has room."""
    spec = RunSpec(payload=MATH, task="mul", additional_args={"op": "mul", "a": 6, "b": 7})
    saturated = threading.Event()
    saturated.set()

    def three_at_once(pool: Pool) -> list[RunResult]:
        results: list[RunResult] = []
        start = threading.Barrier(3)

        def one() -> None:
            start.wait()
            results.append(pool.run(spec))

        threads = [threading.Thread(target=one) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [r.status for r in results] == ["succeeded"] * 3, [r.error for r in results]
        return results

    with Pool(size=1, ttl=60, builders=1, defer=saturated.is_set) as pool:
        pool.keep_ready(prepare(spec))
        busy = three_at_once(pool)
        saturated.clear()
        room = three_at_once(pool)
    assert all(r.warm for r in busy), [r.warm for r in busy]
    assert not all(r.warm for r in room), "with room on the host, no run started cold"
    assert no_leftovers() == [], "a sandbox was left when the pool closed"


class GatedBackend(DockerBackend):
    """Holds each pooled sandbox's making at its start until the test lets them all go, and
    counts how many were being made at once."""

    def __init__(self, client, per_core: int) -> None:  # a docker client
        super().__init__(client)
        self.per_core = per_core
        self.in_flight = self.most = 0
        self.go = threading.Event()
        self._lock = threading.Lock()

    def starts_per_core(self, spec: SandboxSpec) -> int:
        return self.per_core

    def create_idle(self, spec: SandboxSpec, progress: Any, ttl: float) -> Sandbox:
        with self._lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            self.go.wait(timeout=120)
            return super().create_idle(spec, progress, ttl)
        finally:
            with self._lock:
                self.in_flight -= 1


@pytest.mark.parametrize("per_core", [1, 2])
def test_the_pool_makes_as_many_at_once_as_the_backend_asks_per_core(
    per_core: int, agent_image: str, docker_client, no_leftovers, monkeypatch
) -> None:
    """Under gVisor a start waits as well as computes: one making per core left the CPU idle
    while runs waited for them. The pool makes `starts_per_core` x cores at once (at least
    MIN_BUILDERS), never more."""
    # The rule on a 2-core host, whatever this one has: on more than 16 cores the makings
    # would outnumber the largest pool (MAX_SIZE), and the test would wait in vain.
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    expected = max(MIN_BUILDERS, per_core * 2)
    backend = GatedBackend(docker_client, per_core)
    spec = RunSpec(payload=MATH, task="mul", additional_args={"op": "mul", "a": 6, "b": 7})
    with Pool(size=min(MAX_SIZE, expected + 2), ttl=60, backend=backend) as pool:
        pool.keep_ready(prepare(spec))
        try:
            wait_for(lambda: backend.in_flight >= expected, timeout=60)
        finally:
            backend.go.set()
        wait_for(lambda: pool.stats()["idle"] == pool.size, timeout=120)
    assert backend.most == expected, (backend.most, expected)
    assert no_leftovers() == []


@pytest.mark.gvisor
def test_docker_asks_for_two_starts_per_core_under_gvisor_only(
    docker_client, sandbox_runtime: str
) -> None:
    backend = DockerBackend(docker_client)
    prepared = prepare(RunSpec(payload=MATH))
    spec = sandbox_spec(prepared, "any-image")
    assert backend.starts_per_core(spec) == (2 if sandbox_runtime == "runsc" else 1)


@pytest.mark.gvisor
def test_a_warm_batch_on_docker_starts_auto_from_the_backends_starts_per_core(
    docker_client, sandbox_runtime: str
) -> None:
    """`--concurrency auto`'s runs per core to start from (`AdaptiveLimit.per_core`): the
    backend's starts per core while the batch's executor keeps sandboxes warm on this host
    (the pool's builders overlap the starts), the controller's default (None) without."""
    backend = DockerBackend(docker_client)
    prepared = prepare(RunSpec(payload=MATH))
    expected = 2 if sandbox_runtime == "runsc" else 1
    assert LocalExecutor(backend).runs_per_core(prepared) == expected
    assert LocalExecutor(backend, pool_size=3).runs_per_core(prepared) == expected
    assert LocalExecutor(backend, pool_size=0).runs_per_core(prepared) is None


def test_at_a_batchs_start_runs_go_cold_only_up_to_what_fills_the_cpu(
    agent_image: str, docker_client, no_leftovers, monkeypatch
) -> None:
    """The CPU's busy share shows a burst of starts only once it is under way: at a batch's
    start (host not yet saturated) every run beyond the builders' makings went cold at once
    (30 of 32 at a fixed 32 on 2 cores). Runs go cold only while fewer than MAKINGS_PER_CORE
    x cores sandboxes are being made, the builders' included; the rest wait for the pool."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # four makings at once, two builders
    # A run gone cold counts as a making for as long as the test lasts (the pool cannot see
    # a cold start end, and guesses until it has timed its own).
    monkeypatch.setattr(pool_module, "MAKING_GUESS", 600.0)
    backend = GatedBackend(docker_client, per_core=1)
    spec = RunSpec(payload=MATH, task="mul", additional_args={"op": "mul", "a": 6, "b": 7})
    prepared = prepare(spec)
    runs = 8
    claims: list[Any] = []
    with Pool(size=runs, ttl=60, backend=backend, defer=lambda: False) as pool:
        pool.keep_ready(prepared, runs=runs)
        threads = [
            threading.Thread(target=lambda: claims.append(pool.claim(prepared)))
            for _ in range(runs)
        ]
        try:
            wait_for(lambda: backend.in_flight == 2, timeout=60)  # the builders, held
            for thread in threads:
                thread.start()
            wait_for(lambda: len(claims) + pool.runs_waiting() == runs, timeout=60)
            cold, waiting = len(claims), pool.runs_waiting()
        finally:
            backend.go.set()
        for thread in threads:
            thread.join(timeout=180)
        warm = [c for c in claims if c is not None]
        for claim in warm:  # what a run would do with its sandbox: remove it
            claim.release()
    assert no_leftovers() == []
    assert (cold, waiting) == (2, 6), f"{cold} runs went cold at once, {waiting} waited"
    assert claims[:2] == [None, None]
    assert len(warm) == 6, f"{len(warm)} of the 6 waiting runs got a sandbox"
