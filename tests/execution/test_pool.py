"""Warm sandboxes (orchestrator/execution/pool.py): hardened like cold ones, empty until a run takes
them, one run each, and stopped by their own keeper when nobody takes them."""

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

import docker.errors
import pytest

from orchestrator import Pool
from orchestrator.backends.docker import DockerBackend
from orchestrator.backends.docker.engine import engine_time
from orchestrator.batch import BatchSpec, run_batch
from orchestrator.errors import ConfigError
from orchestrator.labels import LABEL_KIND, LABEL_RUN_ID, LABEL_WARM
from orchestrator.lifecycle.runner import build_request, prepare, sandbox_spec
from orchestrator.payloads.manifest import load_manifest
from orchestrator.spec import RunSpec
from tests.conftest import REPO, TEST_PAYLOADS, cli, events_of, our_containers, wait_for
from tests.model_server import ScriptedModelServer

pytestmark = pytest.mark.docker

LEAKY = TEST_PAYLOADS / "leaky"
SLEEPER = TEST_PAYLOADS / "sleeper"
MATH = TEST_PAYLOADS / "batch_math"
SECRET = "warm-s3cr3t-Never-Before-The-Run-9917"
#: Entrypoint words that differ by design: the keeper's deadline arguments.
KEEPER_ARGS = {"--deadline-at", "--idle-until", "--restorable-idle", "--run-seconds"}


def _hardening(info: dict) -> dict:
    """Everything of a container's `docker inspect` that makes its hardening, its identity
    (name, run id, owner, the keeper's times) left out."""
    config = dict(info["Config"])
    labels = {k: v for k, v in config.pop("Labels").items() if k not in (LABEL_RUN_ID, LABEL_WARM)}
    entrypoint = config.pop("Entrypoint")
    split = entrypoint.index("--")
    keeper = [w for w in entrypoint[:split] if not w.replace(".", "").isdigit()]
    keeper = [w for w in keeper if w not in KEEPER_ARGS]
    return {
        "HostConfig": info["HostConfig"],
        "Config": {**config, "Labels": labels, "Entrypoint": keeper + entrypoint[split:]},
        "Mounts": info["Mounts"],
        "AppArmorProfile": info["AppArmorProfile"],
    }


@pytest.mark.gvisor
@pytest.mark.parametrize("network", ["none", "allowlist"])
def test_warm_sandbox_is_hardened_exactly_like_a_cold_one(
    agent_image: str, docker_client, network: str, openai_key: str, no_leftovers
) -> None:
    spec = RunSpec(payload=LEAKY, network=network, allow_hosts=("example.com",))
    if network == "none":
        spec = replace(spec, allow_hosts=())
    prepared = prepare(replace(spec, env_file=None), secret_values=False)
    backend = DockerBackend(docker_client)
    image = backend.prepare_image(prepared.image_requirements, lambda _m: None)
    cold = backend.create(sandbox_spec(prepared, image), lambda _m: None)
    warm_prepared = replace(prepared, run_id=prepared.run_id + "-w")
    warm = backend.create_idle(sandbox_spec(warm_prepared, image), lambda _m: None, ttl=60)
    try:
        cold_info = docker_client.api.inspect_container(cold.id)
        warm_info = docker_client.api.inspect_container(warm.id)
        assert warm_info["State"]["Running"]
        # Created, not started; unless restored from a snapshot (gVisor, `none`): running.
        assert cold_info["State"]["Running"] == bool(cold.restored_from)
        assert warm_info["Config"]["Labels"][LABEL_WARM] == "true"
        assert warm_info["Config"]["Labels"][LABEL_RUN_ID] == warm_prepared.run_id
        cold_fields, warm_fields = _hardening(cold_info), _hardening(warm_info)
        if network == "allowlist":  # each run has its own network and proxy address
            for fields in (cold_fields, warm_fields):
                fields["HostConfig"].pop("NetworkMode")
                fields["Config"]["Env"] = sorted(e.split("=")[0] for e in fields["Config"]["Env"])
        for section, cold_value in cold_fields.items():
            if not isinstance(cold_value, dict):
                assert warm_fields[section] == cold_value, section
                continue
            for name, value in cold_value.items():
                assert warm_fields[section].get(name) == value, (section, name)
            assert set(warm_fields[section]) == set(cold_value), section
    finally:
        cold.remove()
        warm.remove()


def test_secrets_and_payload_reach_an_idle_sandbox_only_when_taken(
    agent_image: str, docker_client, store_label: str, monkeypatch, no_leftovers
) -> None:
    monkeypatch.setenv("LEAKY_SECRET", SECRET)
    spec = RunSpec(payload=LEAKY)
    with Pool(size=2, ttl=60) as pool:
        pool.keep_ready(prepare(spec))
        wait_for(lambda: pool.stats()["idle"] == 2, timeout=60)
        idle = [c for c in our_containers(docker_client, store_label) if c["State"] == "running"]
        assert len(idle) == 2
        time.sleep(1)  # the runtimes have imported smolagents and wait on their stdin
        look = textwrap.dedent("""
            import glob, json, os
            seen = {"environ": [], "files": []}
            for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
                try:
                    seen["environ"].append(open(path, "rb").read().decode("latin-1"))
                except OSError as exc:
                    seen["environ"].append(f"{path}: {exc.strerror}")
            for top in ("/tmp", "/work", "/dev/shm"):
                for root, dirs, files in os.walk(top):
                    for name in files:
                        path = os.path.join(root, name)
                        seen["files"].append([path, open(path, "rb").read().decode("latin-1")])
            print(json.dumps(seen))
        """)
        for container in idle:
            exec_id = docker_client.api.exec_create(container["Id"], ["python", "-c", look])
            seen = json.loads(docker_client.api.exec_start(exec_id))
            assert len(seen["environ"]) >= 4, seen  # the keeper, the runtime, this process
            text = json.dumps(seen) + json.dumps(
                docker_client.api.inspect_container(container["Id"])
            )
            for absent in (SECRET, "LEAKY_SECRET", "leaky.py", "build_manager", "read_secret"):
                assert absent not in text, f"{absent!r} in an idle sandbox"
        result = pool.run(spec)
    assert result.status == "succeeded", result.error
    assert result.warm and result.timings["sandbox_wait"] >= 0
    assert f"secret-length={len(SECRET)}" in str(result.answer)
    created = next(e for e in events_of(result) if e["type"] == "sandbox_created")
    assert created["sandbox_id"] in {c["Id"] for c in idle}
    assert created["warm"] is True


LOADED_LIBRARIES = """
import glob
seen = set()
for path in glob.glob("/proc/[0-9]*/maps"):
    try:
        seen.update(line.split()[-1] for line in open(path) if ".so" in line)
    except OSError:
        pass  # the keeper is not dumpable
print("\\n".join(sorted(seen)))
"""


def test_an_idle_sandbox_has_its_models_client_library_loaded(
    agent_image: str, docker_client, store_label: str, openai_key: str, no_leftovers
) -> None:
    """An `openai` run's sandbox imports openai (about 0.6 s) while it idles, not once taken;
    a `mock` run's sandbox does not load it at all."""
    openai = RunSpec(payload=MATH, model="openai:gpt-4o-mini", api_base="http://127.0.0.1:9/v1")
    with Pool(size=2, ttl=60) as pool:
        pool.keep_ready(prepare(openai), count=1)
        pool.keep_ready(prepare(RunSpec(payload=MATH)), count=1)
        wait_for(lambda: pool.stats()["idle"] == 2, timeout=90)
        loaded = {}
        for container in our_containers(docker_client, store_label):
            info = docker_client.api.inspect_container(container["Id"])
            labels = info["Config"]["Labels"]
            if info["State"]["Running"] and labels.get(LABEL_KIND) == "sandbox":
                exec_id = docker_client.api.exec_create(
                    container["Id"], ["python", "-c", LOADED_LIBRARIES], user="10001:10001"
                )
                entrypoint = " ".join(info["Config"]["Entrypoint"])
                loaded[entrypoint] = docker_client.api.exec_start(exec_id).decode()
    with_client = [libs for argv, libs in loaded.items() if "--preload openai" in argv]
    without = [libs for argv, libs in loaded.items() if "--preload" not in argv]
    assert len(with_client) == 1 and len(without) == 1, list(loaded)
    for libraries in (*with_client, *without):  # the probe reads the runtime's own maps
        assert "_imaging" in libraries, libraries[-2000:]  # PIL, which smolagents imports
    assert "_pydantic_core" in with_client[0], with_client[0][-2000:]  # openai's pydantic
    assert "_pydantic_core" not in without[0]


@pytest.mark.gvisor
def test_a_warm_run_returns_with_its_sandbox_gone_and_its_helpers_follow(
    agent_image: str,
    docker_client,
    store_label: str,
    openai_key: str,
    sandbox_runtime: str,
    no_leftovers,
) -> None:
    """A warm hosted run's result does not wait for its network and gateway to be removed
    (about 0.3 s), but its sandbox is gone when the result comes, and the rest by the time
    the pool is closed."""
    answer = load_manifest(MATH).mock_scripts["manager"][0]
    with ScriptedModelServer([answer]) as server:
        spec = RunSpec(
            payload=MATH,
            task="mul",
            additional_args={"op": "mul", "a": 6, "b": 7},
            model="openai:scripted",
            api_base=server.api_base(),
        )
        with Pool(size=1, ttl=60) as pool:
            pool.keep_ready(prepare(spec))
            wait_for(lambda: pool.stats()["idle"] == 1, timeout=90)
            result = pool.run(spec)
            assert result.status == "succeeded" and result.answer == 42, result.error
            assert result.warm and result.sandbox["runtime"] == sandbox_runtime
            created = next(e for e in events_of(result) if e["type"] == "sandbox_created")
            with pytest.raises(docker.errors.NotFound):
                docker_client.api.inspect_container(created["sandbox_id"])
    assert len(server.requests) == 1
    mine = {"label": [f"{LABEL_RUN_ID}={result.run_id}"]}
    assert docker_client.api.containers(all=True, filters=mine) == []
    assert docker_client.api.networks(filters=mine) == []


@pytest.mark.parametrize(
    ("size", "ttl", "words"),
    [
        (0, 60, "size from 1 to 32"),
        (33, 60, "size from 1 to 32"),
        (10**6, 60, "size from"),
        (2, 1, "from 15 to 3600"),
        (2, 10**7, "from 15 to 3600"),
    ],
)
def test_a_pool_has_bounds(size: int, ttl: float, words: str) -> None:
    """Every limit has a default and a bound: a pool's size and its sandboxes' time-to-live."""
    with pytest.raises(ConfigError) as refused:
        Pool(size=size, ttl=ttl)
    assert words in refused.value.fix


@pytest.mark.parametrize("warm", ["-1", "33", "100000"])
def test_batch_warm_out_of_range_is_refused_before_anything_starts(
    tmp_path: Path, warm: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    row = {"id": "a", "task": "mul", "expected": 42, "additional_args": {"a": 6, "b": 7}}
    tasks.write_text(json.dumps(row) + "\n")
    out = tmp_path / "out"
    refused = cli("batch", str(MATH), str(tasks), "-o", str(out), "--warm", warm)
    assert refused.returncode == 2, refused.stderr
    assert "--warm must be from 0 (--no-warm) to 32" in refused.stderr
    assert not out.exists()


def test_keepers_stop_idle_and_taken_sandboxes_without_the_host(
    agent_image: str, docker_client, no_leftovers
) -> None:
    """With stdin held open (a live host that does nothing), an idle sandbox stops at its
    time-to-live; a taken one at its run's limit + grace from the take, not the TTL."""
    backend = DockerBackend(docker_client)
    prepared = prepare(
        RunSpec(payload=SLEEPER, additional_args={"seconds": 300}, timeout_seconds=2)
    )
    image = backend.prepare_image(prepared.image_requirements, lambda _m: None)
    idle = backend.create_idle(sandbox_spec(prepared, image), lambda _m: None, ttl=15)
    taken_run = replace(prepared, run_id=prepared.run_id + "-t")
    taken = backend.create_idle(sandbox_spec(taken_run, image), lambda _m: None, ttl=120)
    try:
        taken.start(build_request(taken_run), {})
        took = time.time()
        states = {}
        for sandbox in (idle, taken):
            states[sandbox.id] = wait_for(
                lambda s=sandbox: (
                    (st := docker_client.api.inspect_container(s.id)["State"])["Running"] is False
                    and st
                ),
                timeout=40,
            )
        idle_state, taken_state = states[idle.id], states[taken.id]
        assert idle_state["ExitCode"] == 124, idle_state
        lived = engine_time(idle_state["FinishedAt"]) - engine_time(idle_state["StartedAt"])
        assert 13 <= lived <= 18, lived
        assert taken_state["ExitCode"] == 124, taken_state
        after_take = engine_time(taken_state["FinishedAt"]) - took
        assert 10 <= after_take <= 16, after_take  # 2 s limit + 10 s grace, not 120 s
    finally:
        idle.remove()
        taken.remove()


def _wakeups(pid: int) -> int:
    """How many times the host process `pid` (all its threads) has gone to sleep and woken."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def test_an_idle_keeper_wakes_for_nothing(agent_image: str, docker_client, no_leftovers) -> None:
    """An idle sandbox's keeper waits on its pipe and its signals without polling: under
    gVisor each wake-up costs CPU that running tasks need. Counted over a 2 s window, on the
    keeper's host process (runc): a keeper polling every 50 ms wakes about 40 times in it;
    a few are allowed for a keeper not yet settled into its wait when the window opens."""
    backend = DockerBackend(docker_client)
    prepared = prepare(RunSpec(payload=SLEEPER, additional_args={"seconds": 1}))
    image = backend.prepare_image(prepared.image_requirements, lambda _m: None)
    idle = backend.create_idle(sandbox_spec(prepared, image), lambda _m: None, ttl=120)
    try:
        keeper = docker_client.api.inspect_container(idle.id)["State"]["Pid"]
        before = _wakeups(keeper)
        time.sleep(2)  # a window to count in, not a wait for something to happen
        woke = _wakeups(keeper) - before
        assert woke <= 5, f"the idle keeper woke {woke} times in 2 s"
    finally:
        idle.remove()


KILLED_POOL = """
import sys, time
from orchestrator.execution.pool import Pool
from orchestrator.lifecycle.runner import prepare
from orchestrator.spec import RunSpec

pool = Pool(size=2, ttl=float(sys.argv[2]))
pool.keep_ready(prepare(RunSpec(payload=sys.argv[1])))
while pool.stats()["idle"] < 2:
    time.sleep(0.1)
print("ready", flush=True)
time.sleep(600)
"""


def test_sigkilled_pool_leaves_nothing_past_the_ttl_and_cleanup_finds_it(
    agent_image: str, docker_client, store_label: str
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
        idle = [c for c in our_containers(docker_client, store_label) if c["State"] == "running"]
        assert len(idle) == 2
        killed = time.monotonic()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    wait_for(
        lambda: (
            not any(docker_client.api.inspect_container(c["Id"])["State"]["Running"] for c in idle)
        ),
        timeout=ttl + 5,
    )
    assert time.monotonic() - killed <= ttl + 5
    left = {c["Id"] for c in our_containers(docker_client, store_label)}
    assert {c["Id"] for c in idle} <= left  # stopped, not yet removed: cleanup's job
    out = cli("cleanup")
    assert out.returncode == 0, out.stderr
    assert not our_containers(docker_client, store_label)


def test_no_container_serves_two_runs_over_a_warm_batch(
    tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    """20 tasks at concurrency 2: ten rounds of the pool taking and refilling, enough to see
    a sandbox serve two runs or the pool fall behind (nine in ten warm, as over 50 tasks)."""
    count = 20
    rows = [
        {
            "id": f"t{i}",
            "task": "mul",
            "additional_args": {"op": "mul", "a": i, "b": 3},
            "expected": i * 3,
        }
        for i in range(count)
    ]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = BatchSpec(tasks=tasks, output=tmp_path / "out", run=RunSpec(payload=MATH), concurrency=2)
    summary = run_batch(spec)
    assert summary.counts["succeeded"] == count and summary.correct == count, summary.counts
    results = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").open()]
    sandboxes, warm = [], 0
    for row in results:
        saved = json.loads((Path(row["record_dir"]) / "result.json").read_text())
        created = [
            e for e in events_of_dir(Path(row["record_dir"])) if e["type"] == "sandbox_created"
        ]
        assert len(created) == 1
        sandboxes.append(created[0]["sandbox_id"])
        warm += saved["warm"]
        assert saved["warm"] is created[0]["warm"]
    assert len(set(sandboxes)) == count, "a sandbox served two runs"
    assert warm >= count * 9 // 10, f"only {warm} of {count} runs were warm"
    assert len({row["run_id"] for row in results}) == count


def events_of_dir(record: Path) -> list[dict]:
    return [json.loads(line) for line in (record / "events.jsonl").read_text().splitlines()]


def test_record_says_cold(agent_image: str, no_leftovers) -> None:
    from orchestrator.lifecycle.runner import run

    result = run(RunSpec(payload=SLEEPER, additional_args={"seconds": 0}))
    assert result.status == "succeeded" and result.warm is False
    assert "sandbox_wait" not in result.timings
    saved = json.loads((Path(result.record_dir) / "result.json").read_text())
    assert saved["warm"] is False


def test_schedule_serve_starts_the_firings_sandbox_before_its_time(
    tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    from datetime import UTC, datetime, timedelta

    from orchestrator.execution.executor import LocalExecutor
    from orchestrator.records.store import Store
    from orchestrator.schedules.file import load_schedules
    from orchestrator.schedules.serve import WARM_AHEAD, Scheduler
    from orchestrator.schedules.store import ScheduleStore
    from tests.schedules.test_schedules import FakeClock, sync, unique, write_schedules

    name = unique("warm")
    path = write_schedules(
        tmp_path,
        {
            "name": name,
            "cron": "@hourly",
            "payload": str(SLEEPER),
            "additional_args": {"seconds": 0},
        },
    )
    start = datetime(2026, 11, 24, 10, 59, 20, tzinfo=UTC)
    fires_at = datetime(2026, 11, 24, 11, 0, tzinfo=UTC)

    class PoolPacedClock(FakeClock):
        """Simulated time that reaches the firing only once the pool has the sandbox asked for
        WARM_AHEAD before it ready, as the real seconds a serve sleeps would let it: how long
        a sandbox takes to start depends on how busy the machine is, the test must not."""

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
    assert clock.slept >= 40 - WARM_AHEAD  # it woke WARM_AHEAD before the firing
    rows = store.history(name, limit=10)
    assert [r["outcome"] for r in rows] == ["succeeded"], log
    run = Store().get_run(rows[0]["run_id"])
    saved = json.loads((Path(run["record_dir"]) / "result.json").read_text())
    assert saved["warm"] is True and saved["run_id"] == rows[0]["run_id"]
