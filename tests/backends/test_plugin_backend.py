"""A backend defined outside the project is a backend like the built-in ones.

`tests/plugins/orchestrator_mirror` (installed into the test environment by scripts/setup.sh)
registers the backend `mirror` through the entry-point group `orchestrator.backends`: Docker's
sandboxes under another name, and nothing in `orchestrator/` names it. It is selectable
wherever a backend is chosen (`run`, `batch`, `images`, `cleanup`, the config file, a
schedules file), appears in `--help`, and its orphans are reaped. Few containers, mock model.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
from pathlib import Path

import pytest

from orchestrator.backends import backend_capabilities, backend_class, get_backend
from orchestrator.backends.base import Backend, ImageStore, Sandbox, WarmSandboxes
from orchestrator.cli.parser import build_parser, subcommands
from orchestrator.labels import LABEL_RUN_ID
from orchestrator.records.store import Store
from orchestrator.registry import backend_entries
from tests.conftest import (
    REPO,
    TEST_PAYLOADS,
    cli,
    our_containers,
    running_sandboxes,
    start_cli,
    wait_for,
)

MIRROR = "mirror"
SLEEPER = TEST_PAYLOADS / "sleeper"


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- registered from outside, and no file of orchestrator/ knows it -------------------------


def test_the_backend_comes_from_a_package_outside_orchestrator() -> None:
    entry = backend_entries()[MIRROR]
    assert entry.distribution == "orchestrator-mirror"
    cls = backend_class(MIRROR)
    assert issubclass(cls, Backend) and cls.name == MIRROR
    where = Path(inspect.getfile(cls)).resolve()
    assert REPO / "tests" / "plugins" in where.parents, where
    assert REPO / "orchestrator" not in where.parents, where
    assert issubclass(cls, WarmSandboxes) and issubclass(cls, ImageStore)  # read unmade
    named = re.compile(r"""["']mirror["']|orchestrator[_-]mirror""")
    for path in (REPO / "orchestrator").rglob("*.py"):
        assert not named.search(path.read_text()), f"{path} names the plugin"


def test_every_backend_option_offers_it_and_says_where_it_comes_from() -> None:
    parser = build_parser()
    offering = set()
    for sub in subcommands(parser):
        for action in sub._actions:
            if "--backend" in action.option_strings:
                assert MIRROR in (action.choices or ()), sub.prog
                assert "mirror (registered by orchestrator-mirror)" in " ".join(
                    (action.help or "").split()
                ), sub.prog
                offering.add(sub.prog.removeprefix(parser.prog).strip())
    wanted = {"run", "batch", "validate", "cleanup", "images build", "images list"}
    assert wanted <= offering, offering
    shown = cli("run", "--help")
    assert shown.returncode == 0 and "mirror (registered by" in " ".join(shown.stdout.split())


def test_config_and_schedules_files_accept_it(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[defaults]\nbackend = "{MIRROR}"\n')
    schedules = tmp_path / "schedules.toml"
    schedules.write_text(
        f'[[schedule]]\nname = "mirror-{os.getpid()}"\ncron = "@daily"\n'
        f'payload = "{SLEEPER}"\nmodel = "mock"\nbackend = "{MIRROR}"\n'
        "additional_args = { seconds = 0 }\n"
    )
    checked = cli(
        "schedule",
        "validate",
        "--file",
        str(schedules),
        "--json",
        env={"ORCHESTRATOR_CONFIG": str(config)},
    )
    assert checked.returncode == 0, checked.stderr
    # A name that is no backend is refused in both files: the check is real.
    config.write_text('[defaults]\nbackend = "mirrors"\n')
    refused = cli("run", str(SLEEPER), env={"ORCHESTRATOR_CONFIG": str(config)})
    assert refused.returncode == 2 and "mirror" in refused.stderr, refused.stderr
    schedules.write_text(schedules.read_text().replace(f'"{MIRROR}"', '"mirrors"'))
    refused = cli("schedule", "validate", "--file", str(schedules))
    assert refused.returncode == 2 and "mirror" in refused.stderr, refused.stderr


# ---- on the real engine --------------------------------------------------------------------


@pytest.mark.docker
def test_run_batch_schedule_and_images_on_it(
    tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[defaults]\nbackend = "{MIRROR}"\n')
    # run, its backend from the config file only
    done = cli(
        "run",
        str(SLEEPER),
        "--arg",
        "seconds=0",
        "--json",
        env={"ORCHESTRATOR_CONFIG": str(config)},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "succeeded" and result["answer"] == "awake", result
    assert result["backend"] == MIRROR
    assert Store().get_run(result["run_id"])["backend"] == MIRROR
    # batch, with --backend
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t1", "task": "sleep", "additional_args": {"seconds": 0}}))
    out = tmp_path / "out"
    batch = cli(
        "batch", str(SLEEPER), str(tasks), "-o", str(out), "--backend", MIRROR, "-j", "1", "-q"
    )
    assert batch.returncode == 0, batch.stderr
    (row,) = lines_of(out / "results.jsonl")
    assert row["status"] == "succeeded", row
    assert Store().get_run(row["run_id"])["backend"] == MIRROR
    # a schedules file's backend
    name = f"mirror-fired-{os.getpid()}"
    schedules = tmp_path / "schedules.toml"
    schedules.write_text(
        f'[[schedule]]\nname = "{name}"\ncron = "@daily"\npayload = "{SLEEPER}"\n'
        f'model = "mock"\nbackend = "{MIRROR}"\nadditional_args = {{ seconds = 0 }}\n'
    )
    fired = cli("schedule", "run", name, "--file", str(schedules), "--quiet")
    assert fired.returncode == 0, fired.stderr
    runs = Store().list_runs(limit=0, schedule=name)
    assert [r["backend"] for r in runs] == [MIRROR], runs
    # images: build (reused: the agent image exists) and list, through the plugin
    built = cli("images", "build", "--backend", MIRROR, "--json")
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["image"] == agent_image
    listed = cli("images", "list", "--backend", MIRROR, "--json")
    assert listed.returncode == 0, listed.stderr
    assert agent_image in {image["tag"] for image in json.loads(listed.stdout)}


def kill_run_midway(docker_client, store_label: str) -> str:
    """A `run --backend mirror` SIGKILLed while its sandbox runs; its run id."""
    proc = start_cli("run", str(SLEEPER), "--arg", "seconds=120", "--backend", MIRROR, "-q")
    try:
        (sandbox,) = wait_for(lambda: running_sandboxes(docker_client, store_label), timeout=180)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    run_id = sandbox["Labels"][LABEL_RUN_ID]
    assert Store().get_run(run_id)["backend"] == MIRROR
    return run_id


def assert_orphaned(run_id: str) -> None:
    row = Store().get_run(run_id)
    assert row["status"] == "infra_error" and row["ended_at"], row
    result = json.loads((Path(row["record_dir"]) / "result.json").read_text())
    assert result["error"]["type"] == "orphaned", result
    assert "what it left was removed" in result["error"]["message"], result


@pytest.mark.docker
def test_its_orphans_are_reaped_by_the_next_command_and_by_cleanup(
    agent_image: str, docker_client, store_label: str
) -> None:
    # The next command that opens the store (tidy) closes the run and removes its container,
    # through the plugin: no name of it anywhere in orchestrator/.
    run_id = kill_run_midway(docker_client, store_label)
    listed = cli("runs", "list")
    assert listed.returncode == 0, listed.stderr
    assert f"closed run {run_id} as infra_error (orphaned)" in listed.stderr, listed.stderr
    assert_orphaned(run_id)
    assert not our_containers(docker_client, store_label)
    # `orchestrator cleanup --backend mirror` does the same on its own.
    run_id = kill_run_midway(docker_client, store_label)
    cleaned = cli("cleanup", "--backend", MIRROR, "--json")
    assert cleaned.returncode == 0, cleaned.stderr
    report = json.loads(cleaned.stdout)
    assert run_id in {item["run_id"] for item in report["removed"]}, report
    assert report["closed_runs"] == [run_id], report
    assert_orphaned(run_id)
    assert not our_containers(docker_client, store_label)


def test_a_backend_lacking_a_capability_is_refused_with_cause_and_fix() -> None:
    """`images list` on a backend without image listing: exit 2, said before it is made."""
    refused = cli("images", "list", "--backend", "e2b")  # no E2B key needed to be refused
    assert refused.returncode == 2, refused.stderr
    assert "e2b backend cannot list images" in refused.stderr
    assert "--backend docker" in refused.stderr and "--backend mirror" in refused.stderr


@pytest.mark.docker
def test_get_backend_makes_the_plugin_with_its_own_name(docker_client) -> None:
    backend = get_backend(MIRROR)
    assert backend.name == MIRROR and backend.capabilities == backend_capabilities(MIRROR)


# ---- nothing outside backends/ asks which backend it has --------------------------------


def backend_questions(source: str, names: tuple[str, ...]) -> list[str]:
    """Where `source` compares a value with a backend's name (==, !=, in, match), or checks
    a backend's or sandbox's method by identity (`type(b).create_idle is not ...`)."""
    import ast

    methods = {
        name
        for cls in (Backend, WarmSandboxes, ImageStore, Sandbox)
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("__")
    }
    found = []

    def names_a_backend(node: ast.AST) -> bool:
        elements = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(e, ast.Constant) and e.value in names for e in elements)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(names_a_backend(operand) for operand in operands):
                found.append(f"line {node.lineno}: compares a backend's name")
            if any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and any(
                isinstance(o, ast.Attribute) and o.attr in methods for o in operands
            ):
                found.append(f"line {node.lineno}: checks a method by identity")
        elif isinstance(node, ast.match_case) and names_a_backend(
            getattr(node.pattern, "value", node.pattern)
        ):
            found.append(f"line {node.lineno}: matches a backend's name")
    return found


def test_no_backend_name_is_compared_outside_backends() -> None:
    from orchestrator.registry import backend_names

    names = backend_names()
    bad = 'if b == "e2b" or name in ("docker", "x"):\n    pass\nif type(b).create_idle is not Backend.create_idle:\n    pass\n'  # noqa: E501
    assert len(backend_questions(bad, names)) == 3  # the scan sees what it looks for
    assert backend_questions('DEFAULT = "docker"\nname = x or "docker"\n', names) == []
    found = {}
    for path in sorted((REPO / "orchestrator").rglob("*.py")):
        if REPO / "orchestrator" / "backends" in path.parents:
            continue
        questions = backend_questions(path.read_text(), names)
        if questions:
            found[str(path.relative_to(REPO))] = questions
    assert not found, f"decide by Capabilities, not by name or method identity: {found}"
