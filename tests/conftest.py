"""Shared fixtures: a private state directory per test session, the real Docker engine, the
agent image built once, and a check that no test leaves a container behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
PAYLOADS = REPO / "agent_payloads"
TEST_PAYLOADS = REPO / "tests" / "payloads"
#: The example payloads a new user runs first (every folder of agent_payloads/).
EXAMPLES = sorted(p for p in PAYLOADS.iterdir() if (p / "manifest.toml").is_file())


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker starts with SIGINT ignored (Ctrl-C is its controller's), and
    every process it starts inherits that: Python then raises no KeyboardInterrupt. The
    Ctrl-C tests (tests/lifecycle/test_interrupts.py, tests/batch/test_session.py) need
    Python's own handler."""
    if hasattr(config, "workerinput"):
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def orchestrator_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test session gets its own store; the wheelhouse cache is shared with the user's."""
    home = tmp_path_factory.mktemp("orchestrator-home")
    saved = {k: os.environ.get(k) for k in ("ORCHESTRATOR_HOME", "ORCHESTRATOR_WHEELHOUSE")}
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    os.environ["ORCHESTRATOR_HOME"] = str(home)
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def sandbox_runtime() -> Iterator[str]:
    """The suite runs its sandboxes on runc (`$ORCHESTRATOR_SANDBOX_RUNTIME` chooses another
    for the whole suite); tests/backends/docker/test_sandbox_kernel.py runs a chosen set on
    gVisor too. Not `auto`: on an engine with gVisor that would move every test onto it, and CI
    time with it."""
    saved = os.environ.get("ORCHESTRATOR_SANDBOX_RUNTIME")
    chosen = os.environ.setdefault("ORCHESTRATOR_SANDBOX_RUNTIME", "runc")
    yield chosen
    if saved is None:
        os.environ.pop("ORCHESTRATOR_SANDBOX_RUNTIME", None)


@pytest.fixture(scope="session", autouse=True)
def runtime_zygote() -> Iterator[None]:
    """The runtime's zygote (tests/runtime_zygote.py), started by the first test that runs
    the runtime locally, ends with the session."""
    yield
    from tests.runtime_zygote import stop_shared_zygote

    stop_shared_zygote()


#: Fixtures that reach the Docker engine themselves; every fixture that needs the engine
#: depends on one of them (agent_image, nothing_left, no_leftovers, e2b_env, fake_e2b, ...).
ENGINE_FIXTURES = frozenset({"docker_client", "e2b_test_server"})

#: The modules that use the session's E2B test server (`e2b_test_server` below): under
#: pytest-xdist one worker runs them all, so their templates are built once (the agent
#: template the conformance kit's runs use is the one backends/e2b/test_backend.py checks: a minute
#: of building each, when the kit had a server of its own). Checked at collection
#: (`pytest_itemcollected`), so a new module cannot be left out unnoticed.
E2B_SERVER_MODULES = frozenset(
    {
        "tests/backends/e2b/test_backend.py",
        "tests/backends/e2b/test_backend_program.py",
        "tests/backends/e2b/test_bedrock.py",
        "tests/backends/e2b/test_gateway.py",
        "tests/backends/e2b/test_warm.py",
        "tests/testing/test_conformance_e2b.py",
    }
)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark `docker` every test whose fixtures reach the engine, so that `-m "not docker"`
    (the fast tier, .ci/run's first step) leaves out exactly the tests that need it. Tests
    that reach it without such a fixture (through the CLI, say) carry the mark themselves.
    Done as each test is collected, before `-m` selects."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if ENGINE_FIXTURES & fixtures:
        item.add_marker(pytest.mark.docker)
    module = item.nodeid.split("::", 1)[0]  # as `work_unit` reads it: where it is collected
    own_server = hasattr(getattr(item, "module", None), "e2b_test_server")  # its own tests
    if "e2b_test_server" in fixtures and not own_server and module not in E2B_SERVER_MODULES:
        raise pytest.UsageError(f"{module} uses e2b_test_server: add it to E2B_SERVER_MODULES")


#: Modules whose test functions are work units of their own (each function's parameters
#: together): the longest modules, so that workers share one instead of one worker running
#: it on alone at the end. Their module-scoped fixtures are made once per worker that runs a
#: part (cheap ones only). test_conformance.py: 400 s of runs in one unit on the loaded
#: machine; the kit of each backend is the worker's own either way (`kit_for`).
SPLIT_MODULES = frozenset({"tests/testing/test_conformance.py"})

#: The work units that take longest (the summary below prints each unit's seconds after a
#: run: refresh this order from CI's), longest first. pytest-xdist hands them out first, so
#: none begins late and runs on alone while the other workers idle; the others follow, those
#: with the most tests first (pytest-xdist's own order). The order is that summary's, from a
#: bare-machine run of the test command (the E2B server's modules build its templates).
LONG_UNITS: tuple[str, ...] = (
    "e2b-server",
    "tests/cluster/test_executor.py",
    "tests/batch/test_session.py",
    "tests/cli/test_output.py",
    "tests/models/test_model_routes.py",
    "tests/testing/test_doctor.py",
    "tests/payloads/test_program.py",
    "tests/backends/docker/test_snapshots.py",
    "tests/faults/test_deadline.py",
    "tests/backends/docker/runsc_direct/test_sandbox.py",
    "tests/backends/docker/test_egress.py",
    "tests/batch/test_epochs.py",
    "tests/testing/test_conformance.py::test_a_broken_backend_fails_exactly_the_check_of_its_promise",
    "tests/testing/test_conformance.py::test_mirror",
    "tests/testing/test_conformance.py::test_docker",
)


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs whole: a test's module, a test function of a
    SPLIT_MODULES module, or every module of the session's E2B test server together."""
    module = nodeid.split("::", 1)[0]
    if module in E2B_SERVER_MODULES:
        return "e2b-server"
    if module in SPLIT_MODULES:
        return nodeid.split("[", 1)[0]
    return module


def unit_rank(unit: str) -> int:
    """Where a work unit is handed out: LONG_UNITS in their order, then every other."""
    return LONG_UNITS.index(unit) if unit in LONG_UNITS else len(LONG_UNITS)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: none without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`pytest -n N` (.ci/run) hands each worker whole work units (`work_unit`): a module runs
    in one worker, in order, its module-scoped fixtures set up once. Workers share nothing
    else: each has its own store (`orchestrator_home`), and its containers, networks and
    `cleanup` carry that store's label. (Not `--dist loadgroup`: pytest-xdist 3.8 marks the
    groups on an attribute pytest 9.2 no longer reads, so every test goes its own way.)

    The longest units go first (`unit_rank`), and a worker takes its next unit only when its
    current one is down to its last test (pytest-xdist's own rule takes it two tests before
    the end: a long test then holds a unit back that an idle worker could have run)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            first = min(self.workqueue, key=unit_rank)  # ties: the queue's own order
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # A worker runs a test once it knows the next (or that none comes): one test
            # left, it waits for its next unit, sent at once.
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return WorkUnitScheduling(config, log)


#: Seconds each work unit took so far (its tests' setup, call and teardown), for the summary.
_unit_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    unit = work_unit(report.nodeid)
    _unit_seconds[unit] = _unit_seconds.get(unit, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The slowest work units: a worker runs each whole, so one long unit begun late keeps
    the run going after the other worker has finished (CI's wall time)."""
    slowest = sorted(_unit_seconds.items(), key=lambda item: -item[1])[:15]
    if slowest and slowest[0][1] >= 1:
        terminalreporter.write_sep("=", "slowest work units (each runs whole in one worker)")
        for unit, seconds in slowest:
            terminalreporter.write_line(f"{seconds:7.1f}s {unit}")


@pytest.fixture(scope="session")
def e2b_test_server() -> Iterator[Any]:
    """One E2B test server for the whole session (tests/e2b_server/), so a template built by
    one module is still there for the next: the build takes a minute or two. Imported when a
    test needs it, so the tests that do not pay nothing for it."""
    from tests.e2b_server.fixtures import session_server

    with session_server() as server:
        yield server


@pytest.fixture(scope="session")
def docker_client():
    from orchestrator.backends.docker import connect

    return connect()


@pytest.fixture(scope="session")
def store_label(orchestrator_home: Path) -> str:
    from orchestrator.labels import LABEL_STORE, store_id

    return f"{LABEL_STORE}={store_id(orchestrator_home)}"


@pytest.fixture(scope="session")
def agent_image(docker_client) -> str:
    from orchestrator.backends.docker.images import ensure_agent_image

    return ensure_agent_image(docker_client, progress=lambda m: print(m, file=sys.stderr))


def our_containers(docker_client, store_label: str) -> list[dict]:
    return docker_client.api.containers(all=True, filters={"label": [store_label]})


def run_containers(docker_client, store_label: str, run_id: str) -> list[dict]:
    """This session's containers of one run. A test that inspects its run's sandbox asks by run
    id: another sandbox of the session (a pool's, a snapshot maker's, one still being removed)
    may carry the same store label, and be gone between the listing and the inspection."""
    from orchestrator.labels import LABEL_RUN_ID

    labels = [store_label, f"{LABEL_RUN_ID}={run_id}"]
    return docker_client.api.containers(all=True, filters={"label": labels})


def running_sandbox(docker_client, store_label: str, run_id: str) -> dict | None:
    """The inspection of one run's sandbox container once it is running; None until then.
    The run's id also labels its gateway, interceptor and squid, and a sandbox whose restore
    from a snapshot failed is removed and made again cold: any of those can be gone between
    the listing and the inspection, so the caller polls (`wait_for`)."""
    import docker

    from orchestrator.labels import LABEL_KIND, LABEL_RUN_ID

    labels = [store_label, f"{LABEL_RUN_ID}={run_id}", f"{LABEL_KIND}=sandbox"]
    for container in docker_client.api.containers(filters={"label": labels}):
        try:
            info = docker_client.api.inspect_container(container["Id"])
        except docker.errors.NotFound:
            continue
        if info["State"]["Running"]:
            return info
    return None


def our_networks(docker_client, store_label: str) -> list[dict]:
    return docker_client.api.networks(filters={"label": [store_label]})


@pytest.fixture
def nothing_starts(docker_client, store_label: str) -> Iterator[None]:
    """Fails the test if a container of this test session was created while it ran (Docker's
    own event log is asked, so one created and removed again still counts)."""
    start = time.time()
    yield
    created = docker_client.api.events(
        since=f"{start:.9f}",
        until=f"{time.time():.9f}",
        decode=True,
        filters={"type": "container", "event": "create", "label": store_label},
    )
    names = [event.get("Actor", {}).get("Attributes", {}).get("name") for event in created]
    assert names == [], f"containers were created: {names}"
    assert our_containers(docker_client, store_label) == []


@pytest.fixture
def nothing_left(docker_client, store_label: str) -> Iterator[None]:
    """Like `no_leftovers`, for the runs' networks too: fails the test if any container
    (sandbox, gateway, proxy) or network of this test session is left when it ends, and
    removes them so one failure does not cascade."""
    yield
    containers = our_containers(docker_client, store_label)
    networks = our_networks(docker_client, store_label)
    for container in containers:
        docker_client.api.remove_container(container["Id"], force=True)
    for network in networks:
        docker_client.api.remove_network(network["Id"])
    assert not containers, f"containers left behind: {[c['Names'] for c in containers]}"
    assert not networks, f"networks left behind: {[n['Name'] for n in networks]}"


@pytest.fixture
def no_leftovers(docker_client, store_label: str) -> Iterator[Callable[[], list[dict]]]:
    """Fails the test if any container of this test session is left when it ends."""

    def alive() -> list[dict]:
        return our_containers(docker_client, store_label)

    yield alive
    leftover = alive()
    for c in leftover:  # remove them so one failure does not cascade
        docker_client.api.remove_container(c["Id"], force=True)
    assert not leftover, f"containers left behind: {[c['Names'] for c in leftover]}"


@pytest.fixture
def example_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values for every secret an example payload declares."""
    from orchestrator.payloads.manifest import load_manifest

    for folder in EXAMPLES:
        for name in load_manifest(folder).secrets:
            monkeypatch.setenv(name, f"example-value-for-{name.lower()}")


@pytest.fixture
def openai_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-egress")
    return "sk-test-egress"


def events_of(result: Any) -> list[dict[str, Any]]:
    """The events of a run's record (events.jsonl), in order."""
    path = Path(result.record_dir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_payload(folder: Path, manifest: str, code: str | None = None) -> Path:
    """A payload folder with `manifest` and an `agent.py` (by default one that only raises)."""
    (folder / "manifest.toml").write_text(manifest)
    (folder / "agent.py").write_text(code or "def build(model):\n    raise NotImplementedError\n")
    return folder


def running_sandboxes(docker_client, store_label: str) -> list[dict]:
    """This test session's sandbox containers that are running a run now: no egress proxies
    or gateways, and no warm sandbox still idle (started ahead for a run id that no run has
    taken yet, so the store has no such run)."""
    from orchestrator.labels import LABEL_RUN_ID
    from orchestrator.records.store import Store

    store = Store()
    return [
        c
        for c in our_containers(docker_client, store_label)
        if (c.get("Labels") or {}).get("orchestrator.kind") == "sandbox"
        and c["State"] == "running"
        and store.get_run((c.get("Labels") or {}).get(LABEL_RUN_ID, "")) is not None
    ]


def start_cli(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """The real `orchestrator` command in the background, in its own process group (so a
    test can SIGKILL all of it with os.killpg); stdout and stderr piped."""
    options: dict[str, Any] = dict(
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    options.update(kwargs)
    return subprocess.Popen([sys.executable, "-m", "orchestrator", *args], **options)


def wait_for(predicate: Callable[[], object], timeout: float = 60, interval: float = 0.1):
    """Poll until `predicate()` is truthy; return its value or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300, **kw):
    """Run the real `orchestrator` command in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def beside_interpreter(venv: str, tool: str, override: str) -> Path:
    """A test tool installed in a virtualenv of its own beside the running interpreter's
    (scripts/setup.sh makes `.venv-phoenix` and `.venv-mitmproxy` next to `.venv`), or the
    path the environment variable `override` names: found through the interpreter the tests
    run in, never through a path in the checkout."""
    named = os.environ.get(override)
    return Path(named) if named else Path(sys.prefix).parent / venv / "bin" / tool


def files_holding(needle: str, *roots: Path) -> list[str]:
    """The files under `roots` (symbolic links not followed) whose bytes contain `needle`,
    read by `grep` in a process of its own. A test must not open the run store's files in
    its own process: closing them drops the POSIX locks that this process's open SQLite
    connections hold (SQLite's documented hazard); another process then takes itself for the
    last reader and deletes the write-ahead log under them (lost writes, "disk I/O error")."""
    found = subprocess.run(
        ["grep", "-rlF", "--binary-files=text", "-D", "skip", "--", needle, *map(str, roots)],
        capture_output=True,
        text=True,
    )
    assert found.returncode in (0, 1), f"grep could not read everything: {found.stderr}"
    return found.stdout.splitlines()
