"""Warm sandboxes on E2B: the real `e2b` SDK against the local E2B test
server. Pooled sandboxes hold nothing of any run until one takes them, serve one run each and
are killed after it, count against ORCHESTRATOR_E2B_MAX_SANDBOXES, and end at their
time-to-live by E2B's own sandbox timeout when no orchestrator process is left. Counted from
what the server saw (creations, kills, commands, uploads), not from what the pool says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import Pool
from orchestrator.backends import get_backend
from orchestrator.batch import BatchSpec, run_batch
from orchestrator.labels import LABEL_RUN_ID, LABEL_WARM
from orchestrator.lifecycle.runner import build_request, prepare, sandbox_spec
from orchestrator.spec import RunSpec
from tests.backends.e2b import test_backend as e2b_tests
from tests.backends.e2b import test_gateway as gateway_tests
from tests.batch.test_session import math_rows, write_jsonl
from tests.conftest import REPO, TEST_PAYLOADS, cli, events_of, wait_for
from tests.e2b_server import E2BTestServer
from tests.model_server import ScriptedModelServer
from tests.test_gateway import code

pytestmark = pytest.mark.docker

e2b_env = e2b_tests.e2b_env
e2b_model = gateway_tests.e2b_model
api_base = gateway_tests.api_base

LEAKY = TEST_PAYLOADS / "leaky"
SLEEPER = TEST_PAYLOADS / "sleeper"
MATH = TEST_PAYLOADS / "batch_math"
PROBE = TEST_PAYLOADS / "gateway_probe"
SECRET = "e2b-warm-s3cr3t-Never-Before-The-Run-5521"

#: Run as root in an idle sandbox's container: every process's environment and command line,
#: and every file under /tmp, /home and /dev/shm.
LOOK = textwrap.dedent("""
    import glob, json, os
    seen = {"environ": [], "files": []}
    for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
        try:
            seen["environ"].append(open(path, "rb").read().decode("latin-1"))
        except OSError as exc:
            seen["environ"].append(f"{path}: {exc.strerror}")
    for top in ("/tmp", "/home", "/dev/shm"):
        for root, dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(root, name)
                try:
                    seen["files"].append([path, open(path, "rb").read().decode("latin-1")])
                except OSError:
                    pass
    print(json.dumps(seen))
""")


def _runtime_commands(server: E2BTestServer, sandbox_id: str) -> list:
    return [
        c
        for c in server.commands
        if c.sandbox_id == sandbox_id and "orchestrator_runtime" in " ".join(c.args)
    ]


def test_an_idle_e2b_sandbox_holds_nothing_of_a_run_until_one_takes_it(
    e2b_env: E2BTestServer, docker_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEAKY_SECRET", SECRET)
    spec = RunSpec(payload=LEAKY, backend="e2b")
    with Pool(size=2, ttl=90) as pool:
        pool.keep_ready(prepare(spec))
        wait_for(lambda: pool.stats()["idle"] == 2, timeout=180)
        idle = e2b_env.alive_ids()
        assert len(idle) == 2
        before = json.dumps([vars(r) for r in e2b_env.requests], default=str)
        for sandbox_id in idle:
            assert e2b_env.sandbox(sandbox_id).metadata[LABEL_WARM] == "true"
            (command,) = _runtime_commands(e2b_env, sandbox_id)
            assert "--request" not in command.args[-1]  # it waits on stdin, no request file
            probe = docker_client.containers.get(f"e2b-test-{sandbox_id}")
            code, output = probe.exec_run(["python3", "-c", LOOK], user="root")
            assert code == 0, output
            seen = json.loads(output)
            runtime = [e for e in seen["environ"] if "orchestrator_runtime" in e]
            assert runtime, "the idle runtime is not running"
            text = json.dumps(seen) + json.dumps(vars(command))
            for absent in (SECRET, "LEAKY_SECRET", "leaky.py", "build_manager", "read_secret"):
                assert absent not in text, f"{absent!r} in an idle sandbox"
        for absent in (SECRET, "build_manager", "read_secret"):
            assert absent not in before, f"{absent!r} was sent before a run took a sandbox"
        result = pool.run(spec)
    assert result.status == "succeeded", result.error
    assert result.warm and f"secret-length={len(SECRET)}" in str(result.answer)
    created = next(e for e in events_of(result) if e["type"] == "sandbox_created")
    taken = created["sandbox_id"]
    assert taken in idle and created["warm"] is True
    assert e2b_env.sandbox(taken).metadata[LABEL_RUN_ID] == result.run_id
    # The request came on the waiting runtime's stdin: no second process, no uploaded file.
    assert len(_runtime_commands(e2b_env, taken)) == 1
    uploads = [r for r in e2b_env.requests if r.sandbox_id == taken and r.path == "/files"]
    assert uploads == []
    for sandbox_id in idle:  # the run's sandbox after its run, the other when the pool closed
        assert e2b_env.sandbox(sandbox_id).killed_reason == "api"
    assert e2b_env.alive_count() == 0
    record = Path(result.record_dir)
    for path in [p for p in record.rglob("*") if p.is_file()]:
        assert SECRET not in path.read_text(), path.name


def test_a_warm_e2b_batch_gives_each_sandbox_one_run_under_the_cap(
    e2b_env: E2BTestServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ORCHESTRATOR_E2B_MAX_SANDBOXES", "3")
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(8))
    spec = BatchSpec(
        tasks=tasks,
        output=tmp_path / "out",
        run=RunSpec(payload=MATH, backend="e2b"),
        concurrency=2,
        warm=2,
    )
    summary = run_batch(spec)
    assert summary.counts["succeeded"] == 8 and summary.correct == 8, summary.counts

    results = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").open()]
    served: dict[str, str] = {}  # sandbox id -> the run it served
    warm_runs = 0
    for row in results:
        record = Path(row["record_dir"])
        events = [json.loads(line) for line in (record / "events.jsonl").open()]
        (created,) = [e for e in events if e["type"] == "sandbox_created"]
        assert created["sandbox_id"] not in served, "an E2B sandbox served two runs"
        served[created["sandbox_id"]] = row["run_id"]
        warm_runs += created["warm"]
    assert warm_runs >= 4, f"only {warm_runs} of 8 runs were warm"

    # What the server saw: one creation per attempt plus the batch's payload check; every
    # sandbox made for the pool (LABEL_WARM) served exactly one run, none was left idle.
    bodies = e2b_env.create_requests
    assert len(bodies) == 8 + 1
    made_warm = [b["metadata"][LABEL_RUN_ID] for b in bodies if b["metadata"].get(LABEL_WARM)]
    assert sorted(made_warm) == sorted(
        run_id
        for sandbox_id, run_id in served.items()
        if e2b_env.sandbox(sandbox_id).metadata.get(LABEL_WARM)
    )
    assert len(made_warm) == warm_runs
    for sandbox_id, run_id in served.items():
        sandbox = e2b_env.sandbox(sandbox_id)
        assert sandbox.metadata[LABEL_RUN_ID] == run_id
        assert sandbox.state == "killed" and sandbox.killed_reason == "api", sandbox_id
        assert len(_runtime_commands(e2b_env, sandbox_id)) == 1
    # idle sandboxes count against the cap: running and idle ones never more than 3
    assert 1 <= e2b_env.max_alive <= 3
    assert e2b_env.alive_count() == 0


def test_taking_an_idle_sandbox_moves_its_e2b_lifetime_to_the_runs(
    e2b_env: E2BTestServer,
) -> None:
    prepared = prepare(
        RunSpec(payload=SLEEPER, backend="e2b", timeout_seconds=5, additional_args={"seconds": 0})
    )
    backend = get_backend("e2b")
    image = backend.prepare_image(prepared.image_requirements, lambda _m: None)
    idle = backend.create_idle(sandbox_spec(prepared, image), lambda _m: None, ttl=30)
    try:
        left = e2b_env.sandbox(idle.id).end_at - time.time()
        assert 0 < left <= 30, left  # the pool's time-to-live, not the run's 5 s + 60 s
        other = replace(prepared, run_id=prepared.run_id + "-other")
        with pytest.raises(ValueError, match="not for run"):
            idle.take(sandbox_spec(other, image))
        idle.take(sandbox_spec(prepared, image))
        left = e2b_env.sandbox(idle.id).end_at - time.time()
        assert 50 < left <= 65, left  # the run's 5 s and the margin, from the take
        idle.start(build_request(prepared), {})
        stdout = b"".join(chunk for name, chunk in idle.stream() if name == "stdout")
        outcome = idle.wait(timeout=60)
        assert outcome.exit_code == 0 and outcome.infra_error is None, (outcome, stdout)
        (end,) = [e for e in map(json.loads, stdout.splitlines()) if e["type"] == "run_end"]
        assert end["state"] == "success" and end["answer"] == "awake", end
    finally:
        idle.remove()
    assert e2b_env.sandbox(idle.id).killed_reason == "api"


KILLED_POOL = """
import sys, time
from orchestrator.execution.pool import Pool
from orchestrator.lifecycle.runner import prepare
from orchestrator.spec import RunSpec

pool = Pool(size=2, ttl=float(sys.argv[2]))
pool.keep_ready(prepare(RunSpec(payload=sys.argv[1], backend="e2b")))
while pool.stats()["idle"] < 2:
    time.sleep(0.1)
print("ready", flush=True)
time.sleep(600)
"""


def test_idle_e2b_sandboxes_end_at_their_ttl_with_the_orchestrator_killed(
    e2b_env: E2BTestServer,
) -> None:
    ttl = 20.0
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_POOL, str(SLEEPER), str(ttl)],
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        idle = e2b_env.alive_ids()
        assert len(idle) == 2
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert sorted(e2b_env.alive_ids()) == sorted(idle)  # nobody left to remove them
    wait_for(lambda: e2b_env.alive_count() == 0, timeout=ttl + 15)
    for sandbox_id in idle:
        sandbox = e2b_env.sandbox(sandbox_id)
        assert sandbox.killed_reason == "timeout", sandbox.killed_reason  # E2B's own end
        # the TTL from its creation (not the run's limit + 60 s, nor E2B's default 300 s)
        assert ttl - 1 <= sandbox.end_at - sandbox.started_at <= ttl + 15
    out = cli("cleanup", "--backend", "e2b", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "would remove" not in out.stdout


def test_schedule_serve_warms_the_firings_e2b_sandbox_before_its_time(
    e2b_env: E2BTestServer, tmp_path: Path
) -> None:
    from datetime import UTC, datetime, timedelta

    from orchestrator.execution.executor import LocalExecutor
    from orchestrator.records.store import Store
    from orchestrator.schedules.file import load_schedules
    from orchestrator.schedules.serve import Scheduler
    from orchestrator.schedules.store import ScheduleStore
    from tests.schedules.test_schedules import FakeClock, sync, unique, write_schedules

    name = unique("e2b-warm")
    path = write_schedules(
        tmp_path,
        {
            "name": name,
            "cron": "@hourly",
            "payload": str(SLEEPER),
            "backend": "e2b",
            "additional_args": {"seconds": 0},
        },
    )
    start = datetime(2026, 11, 24, 10, 59, 20, tzinfo=UTC)
    fires_at = datetime(2026, 11, 24, 11, 0, tzinfo=UTC)

    class PoolPacedClock(FakeClock):
        """Simulated time that reaches the firing only once the warm sandbox is ready."""

        def sleep(self, seconds: float, stop: threading.Event) -> bool:
            if self.t < fires_at <= self.t + timedelta(seconds=seconds):
                wait_for(lambda: pool.stats()["idle"] == 1, timeout=180)
            return super().sleep(seconds, stop)

    clock = PoolPacedClock(start, start + timedelta(seconds=45))
    log: list[str] = []
    store = ScheduleStore()
    with Pool(size=1, ttl=60) as pool:
        scheduler = Scheduler(
            load_schedules(path).schedules,
            store=store,
            clock=clock,
            spawn=sync,
            log=log.append,
            executor=LocalExecutor(pool=pool),
        )
        scheduler.serve(threading.Event())
        assert pool.stats() == {"idle": 0, "making": 0}, "a sandbox was made past the firing"
    rows = store.history(name, limit=10)
    assert [r["outcome"] for r in rows] == ["succeeded"], log
    run = Store().get_run(rows[0]["run_id"])
    saved = json.loads((Path(run["record_dir"]) / "result.json").read_text())
    assert saved["warm"] is True and saved["backend"] == "e2b"
    (body,) = e2b_env.create_requests
    assert body["metadata"][LABEL_WARM] == "true"
    assert body["metadata"][LABEL_RUN_ID] == rows[0]["run_id"]
    assert e2b_env.alive_count() == 0


def test_idle_sandboxes_count_against_the_cap_and_close_removes_every_one(
    e2b_env: E2BTestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool larger than ORCHESTRATOR_E2B_MAX_SANDBOXES: its third sandbox waits for a slot
    (never a third alive on E2B); closing the pool frees the slots, and the sandbox that got
    one then is removed too before `close` returns."""
    monkeypatch.setenv("ORCHESTRATOR_E2B_MAX_SANDBOXES", "2")
    prepared = prepare(RunSpec(payload=SLEEPER, backend="e2b"))
    pool = Pool(size=3, ttl=60)
    try:
        pool.keep_ready(prepared)
        wait_for(lambda: pool.stats() == {"idle": 2, "making": 1}, timeout=180)
        assert e2b_env.alive_count() == 2
    finally:
        pool.close()
    assert e2b_env.alive_count() == 0
    assert e2b_env.max_alive == 2
    for body in e2b_env.create_requests:
        assert body["metadata"][LABEL_WARM] == "true"


def test_a_warm_e2b_sandbox_of_a_hosted_model_reaches_it_only_through_its_gateway(
    e2b_model: str, e2b_env: E2BTestServer
) -> None:
    """A pooled sandbox of a hosted model is made with its gateway sandbox, as a cold one is:
    the run that takes it calls the model through the gateway (the real key from there, the
    tokens measured there), the key is nowhere in the run's sandbox (the probe reads every
    process's environment, /tmp, /work and its own memory), and both sandboxes are gone
    after."""
    key = e2b_model
    look = code("result = look_for_key()\nfinal_answer(result)")
    with ScriptedModelServer([look]) as server:
        spec = RunSpec(
            payload=PROBE, model="openai:scripted", api_base=api_base(server), backend="e2b"
        )
        with Pool(size=1, ttl=60) as pool:
            pool.keep_ready(prepare(spec))
            wait_for(lambda: pool.stats()["idle"] == 1, timeout=120)
            result = pool.run(spec)
        headers = [r["headers"] for r in server.requests]
    assert result.status == "succeeded", result.error
    assert result.warm is True
    report = json.loads(result.answer)
    assert "memory" in report["found"], report  # it did look (its own marker is there)
    tail = key[len("sk-gwtest-") :][:32][::-1]  # as the probe reports what it saw
    assert not [place for place, tails in report["found"].items() if tail in tails], report
    assert headers == [headers[0]] and headers[0]["Authorization"] == f"Bearer {key}"
    assert result.gateway["enabled"] is True and result.gateway["calls"] == 1
    assert result.token_usage_source == "gateway"
    sent = json.dumps(list(e2b_env.create_requests)) + json.dumps(
        [c.envs for c in e2b_env.commands]
    )
    assert key not in sent
    assert e2b_env.alive_count() == 0
