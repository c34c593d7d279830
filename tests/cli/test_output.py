"""The command line as a user and a script meet it, through the real `orchestrator` command
and real sandboxes: closed pipes, JSON errors, run ids, housekeeping, defaults precedence,
`new`, and snapshots of the main human outputs on a terminal and piped
(tests/cli/snapshots/, rewritten with UPDATE_SNAPSHOTS=1)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import PAYLOADS, REPO, TEST_PAYLOADS, cli, start_cli, wait_for

pytestmark = pytest.mark.docker
SNAPSHOTS = Path(__file__).parent / "snapshots"
#: Rich believes it writes to a terminal: tables, colours (stripped below), a fixed width.
TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "200", "TERM": "xterm"}
PIPED = {"NO_COLOR": "1", "FORCE_COLOR": "", "TTY_COMPATIBLE": "0"}


@pytest.fixture(scope="module")
def two_runs(agent_image: str) -> list[str]:
    """Two runs of the shipped example, named by its bare name (no folder of that name here)."""
    ids = []
    for _ in range(2):
        out = cli("run", "research_team", "--json", env=PIPED)
        assert out.returncode == 0, out.stderr
        ids.append(json.loads(out.stdout)["run_id"])
    return ids


def closed_early(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with a stdout whose reader has gone before the first byte (`| head -0`)."""
    proc = start_cli(*args)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    stderr = proc.stderr.read()
    return subprocess.CompletedProcess(args, proc.wait(timeout=120), "", stderr)


def test_a_reader_that_closes_early_sees_no_traceback(two_runs: list[str], no_leftovers) -> None:
    for args in (
        ("runs", "list", "--json"),
        ("runs", "logs", two_runs[0]),
        ("run", "research_team", "--json"),
    ):
        out = closed_early(*args)
        assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
        assert out.returncode == 141, (args, out.returncode, out.stderr)  # as `cat` would


def first_line_then_closed(
    *args: str, env: dict[str, str], streams: str
) -> subprocess.CompletedProcess[str]:
    """The command with its reader gone after the first line (`2>&1 | head -1` when
    `streams` is "both"; only stderr's reader when "stderr", stdout then read whole)."""
    both = streams == "both"
    proc = start_cli(
        *args, env={**os.environ, **env}, stderr=subprocess.STDOUT if both else subprocess.PIPE
    )
    pipe = proc.stdout if both else proc.stderr
    assert pipe is not None
    first = pipe.readline()
    pipe.close()
    rest = "" if both or proc.stdout is None else proc.stdout.read()
    return subprocess.CompletedProcess(args, proc.wait(timeout=300), rest, first)


def private_store(tmp_path: Path, docker_client, agent_image: str) -> dict[str, str]:
    """The environment of commands on a store of their own, piped output, and the agent
    image's own base (so that no machine-dependent pull is tried)."""
    base = docker_client.images.get(agent_image).labels["orchestrator.base"]
    return {"ORCHESTRATOR_HOME": str(tmp_path / "home"), "ORCHESTRATOR_BASE_IMAGE": base, **PIPED}


def recorded(env: dict[str, str]) -> list[dict]:
    """Every run of the store `env` names, as `runs show --json` gives it."""
    listed = cli("runs", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    shown = [
        cli("runs", "show", row["run_id"], "--json", env=env) for row in json.loads(listed.stdout)
    ]
    return [json.loads(out.stdout) for out in shown]


def test_a_reader_gone_mid_run_changes_nothing_in_its_record(
    tmp_path: Path, docker_client, agent_image: str, no_leftovers
) -> None:
    """`run research_team 2>&1 | head -2` (before: the live display died with
    its reader, the host lost the result and recorded `infra_error`, exit 1 with a traceback).
    The run goes on, is recorded `succeeded` with its answer, and the command exits 141 as a
    writer whose reader went away, without a traceback; with only stderr gone the answer
    still reaches stdout."""
    env = private_store(tmp_path, docker_client, agent_image)
    for streams in ("both", "stderr"):
        out = first_line_then_closed("run", "research_team", env=env, streams=streams)
        assert out.stderr.startswith("▶ run started"), out.stderr  # the line it was read to
        assert out.returncode == 141, (streams, out.returncode)  # a traceback would exit 1
        if streams == "stderr":
            assert out.stdout == "48\n", out.stdout
    runs = recorded(env)
    assert [(r["status"], r["answer"]) for r in runs] == [("succeeded", 48)] * 2, runs
    assert not any(
        e.get("type") == "observer_failed"
        for r in runs
        for e in map(json.loads, Path(r["record_dir"], "events.jsonl").read_text().splitlines())
    )  # the CLI's display never failed: it wrote into the void


def test_a_reader_gone_mid_batch_changes_no_task(
    tmp_path: Path, docker_client, agent_image: str, no_leftovers
) -> None:
    """For `batch`: its progress' reader gone after the first line, every
    task is still run and recorded `succeeded` with its answer; exit 141, no traceback
    (stderr holds only the line read)."""
    env = private_store(tmp_path, docker_client, agent_image)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"id": f"t{i}", "task": "How many years?"}) + "\n" for i in range(2))
    )
    output = tmp_path / "out"
    out = first_line_then_closed(
        "batch", "research_team", str(tasks), "-o", str(output), env=env, streams="both"
    )
    assert out.returncode == 141, (out.returncode, out.stderr)
    results = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["status"], r["answer"]) for r in results) == [
        ("t0", "succeeded", 48),
        ("t1", "succeeded", 48),
    ]
    assert [(r["status"], r["answer"]) for r in recorded(env)] == [("succeeded", 48)] * 2


def test_an_observer_that_fails_never_fails_the_run(agent_image: str, no_leftovers) -> None:
    """In the Python API: an `on_event` that raises (a print to a closed
    pipe, a bug) is dropped and noted in the record; the run is recorded as it ended."""
    import orchestrator
    from orchestrator.spec import RunSpec
    from tests.conftest import PAYLOADS, events_of

    def broken(event: dict) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    result = orchestrator.run(
        RunSpec(payload=str(PAYLOADS / "research_team"), model="mock"), on_event=broken
    )
    assert (result.status, result.answer) == ("succeeded", 48), result.error
    failed = [e for e in events_of(result) if e["type"] == "observer_failed"]
    assert len(failed) == 1 and "BrokenPipeError" in failed[0]["error"], failed


def test_the_max_steps_shown_are_those_each_agent_had(
    tmp_path: Path, docker_client, agent_image: str, no_leftovers
) -> None:
    """The limits shown are those that ran (before: `run --help` said "manifest, else 10",
    and `runs show` printed `max_steps 10` for a payload that set none, while each agent
    kept its own). `runs show`,
    its `--json`, the viewer's page and `run --help` say what the record's `run_start` says
    each agent had and who set it: for a manifest that sets none, one that sets 4, and a run
    that sets 3."""
    import shutil

    env = private_store(tmp_path, docker_client, agent_image)
    manifest = (PAYLOADS / "research_team" / "manifest.toml").read_text()
    assert "\nmax_steps = 6\n" in manifest
    cases = {}
    for name, limit in (("unset", ""), ("four", "max_steps = 4\n")):
        folder = shutil.copytree(PAYLOADS / "research_team", tmp_path / name)
        (folder / "manifest.toml").write_text(manifest.replace("max_steps = 6\n", limit))
        cases[name] = (str(folder),)
    cases["flag"] = (str(tmp_path / "four"), "--max-steps", "3")
    expected = {
        "unset": ([("manager", 6, "program"), ("librarian", 5, "program")], None),
        "four": ([("manager", 4, "manifest"), ("librarian", 4, "manifest")], 4),
        "flag": ([("manager", 3, "run"), ("librarian", 3, "run")], 3),
    }
    for name, args in cases.items():
        ran = cli("run", *args, "--json", env=env)
        assert ran.returncode == 0, ran.stderr
        run_id = json.loads(ran.stdout)["run_id"]
        shown = json.loads(cli("runs", "show", run_id, "--json", env=env).stdout)
        start = next(
            json.loads(line)
            for line in Path(shown["record_dir"], "events.jsonl").read_text().splitlines()
            if json.loads(line)["type"] == "run_start"
        )
        had = [(a["name"], a["max_steps"], a["max_steps_from"]) for a in start["agents"]]
        agents, limit = expected[name]
        assert had == agents, (name, had)  # the record: what ran
        assert [(a["agent"], a["max_steps"], a["from"]) for a in shown["agent_max_steps"]] == had
        assert shown["limits"]["max_steps"] == limit, (name, shown["limits"])
        text = cli("runs", "show", run_id, env=env).stdout
        line = " · ".join(f"{a} {n} ({source})" for a, n, source in had)
        assert f"max steps:       {line}\n" in text, text
        limits = next(x for x in text.splitlines() if x.startswith("limits:"))
        assert ("max_steps" in limits) == (limit is not None), limits
        if limit is not None:
            assert f"max_steps {limit} ·" in limits, limits
        page = tmp_path / f"view-{name}"
        exported = cli("view", "--export", str(page), run_id, env=env)
        assert exported.returncode == 0, exported.stderr
        html = next(page.rglob(f"*{run_id}*.html")).read_text()
        assert f'<dd id="max-steps">{line} ' in html.replace("&#39;", "'"), html
    helped = " ".join(cli("run", "--help", env=env).stdout.split())
    assert "manifest, else 10)" not in helped
    assert (
        "--max-steps MAX_STEPS steps of the top agent; its managed agents get at most as many "
        "(default: the manifest's [limits] max_steps, the same way; else each agent keeps the "
        "max_steps its program gave it"
    ) in helped, helped


def test_run_refuses_what_validate_refuses_before_the_first_step(
    tmp_path: Path, docker_client, agent_image: str, no_leftovers
) -> None:
    """`run` refuses what `validate` refuses (before: `validate` named a mock script keyed
    for no agent, while `run` started, exhausted the agent's empty script and reported
    `succeeded`). The run makes the same check (one function, in the sandbox once the tree
    is loaded) and is refused before any model call: exit 2, `failed` with `payload_error`
    and the very problems `validate` lists. Here the librarian's name is not a literal of
    the source, so the check is the sandbox's; with a literal, the host refuses before any
    sandbox (test_program.py, test_run_refuses_a_mock_script_for_no_agent_before_any_sandbox)."""
    import shutil

    env = private_store(tmp_path, docker_client, agent_image)
    folder = shutil.copytree(PAYLOADS / "research_team", tmp_path / "misspelled")
    manifest, team = folder / "manifest.toml", folder / "team.py"
    assert manifest.read_text().count("\nlibrarian = [") == 1
    manifest.write_text(manifest.read_text().replace("\nlibrarian = [", "\nlibrarain = ["))
    assert team.read_text().count('name="librarian"') == 1
    team.write_text(
        team.read_text().replace('name="librarian"', "name=NAME") + 'NAME = "librarian"\n'
    )
    checked = cli("validate", str(folder), "--json", env=env)
    assert checked.returncode == 2, checked.stderr
    problems = json.loads(checked.stdout)["problems"]
    assert any("mock script for 'librarain', which is not an agent" in p for p in problems)
    ran = cli("run", str(folder), env=env)
    assert ran.returncode == 2, ran.stderr
    assert "mock script for 'librarain', which is not an agent" in ran.stderr, ran.stderr
    (row,) = json.loads(cli("runs", "list", "--json", env=env).stdout)  # the check is no run
    shown = json.loads(cli("runs", "show", row["run_id"], "--json", env=env).stdout)
    assert (shown["status"], shown["error"]["type"]) == ("failed", "payload_error"), shown
    assert shown["error"]["problems"] == problems  # the same check, the same words
    events = Path(shown["record_dir"], "events.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["type"] for line in events]
    assert "run_start" in kinds and "step" not in kinds, kinds  # loaded, never stepped
    assert shown["steps"] == 0 and not any(shown["token_usage"].values()), shown


def test_run_ids_by_prefix_or_suffix_and_ambiguity_named(two_runs: list[str]) -> None:
    first, second = two_runs
    by_suffix = cli("runs", "show", first[-6:], "--json")
    assert by_suffix.returncode == 0 and json.loads(by_suffix.stdout)["run_id"] == first
    by_prefix = cli("runs", "show", first[:-3], "--json")
    assert json.loads(by_prefix.stdout)["run_id"] == first
    ambiguous = cli("runs", "show", "r-")
    assert ambiguous.returncode == 2
    assert "ambiguous" in ambiguous.stderr and first in ambiguous.stderr
    assert second in ambiguous.stderr
    unknown = cli("runs", "logs", "no-such-run")
    assert unknown.returncode == 2 and "No run 'no-such-run'" in unknown.stderr


def test_runs_stop_ends_one_running_run_cancelled(agent_image: str, no_leftovers) -> None:
    """`runs stop RUN` (before: no such command, exit 2 from argparse): the
    run's own process ends it `cancelled` (exit 130) and removes its sandbox."""
    import time

    from orchestrator.records.store import Store

    started = time.time()
    sleeper = str(TEST_PAYLOADS / "sleeper")
    proc = start_cli("run", sleeper, "--arg", "seconds=50", "--quiet")
    try:
        row = wait_for(
            lambda: next(
                (
                    r
                    for r in Store().list_runs(status="running", limit=50)
                    if r["payload"] == "sleeper" and r["created_at"] >= started
                ),
                None,
            ),
            timeout=120,
        )
        stopped = cli("runs", "stop", row["run_id"].rsplit("-", 1)[-1][:8])
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.strip() == f"stopped {row['run_id']}: cancelled"
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
        proc.communicate()
    assert time.time() - started < 50  # stopped, not ended by its own sleep
    again = cli("runs", "stop", row["run_id"])
    assert again.returncode == 2 and "is not running (status: cancelled)" in again.stderr


def test_a_local_folder_shadowing_an_example_and_a_mock_off_its_task_are_said(
    tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    """`new research_team` then `run research_team` runs the folder,
    saying so and how to run the example; the mock model given another task says that its
    answer is not about it (before: no word, the answer `48`)."""

    def here(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    made = here("new", "research_team")
    assert made.returncode == 0, made.stderr
    checked = here("validate", "research_team", "--no-load")
    example = REPO / "agent_payloads" / "research_team"
    assert "notice: 'research_team' is the folder ./research_team here" in checked.stderr
    assert f"orchestrator run {example}" in checked.stderr, checked.stderr
    alone = cli("validate", "research_team", "--no-load")  # no folder here: no notice
    assert "notice" not in alone.stderr, alone.stderr
    off_task = cli("run", "research_team", "Who wrote Dune?", "--model", "mock", env=PIPED)
    assert off_task.returncode == 0, off_task.stderr
    assert "notice: the mock model plays the payload's [mock.scripts]" in off_task.stderr
    on_task = cli("run", "research_team", "--model", "mock", env=PIPED)
    assert on_task.returncode == 0 and "notice" not in on_task.stderr, on_task.stderr


def test_bad_input_under_json_prints_an_error_object(tmp_path: Path) -> None:
    missing = cli("run", str(tmp_path / "nothing-here"), "--json")
    assert missing.returncode == 2
    error = json.loads(missing.stdout)["error"]
    assert "No payload manifest" in error["cause"] and error["fix"] and error["exit_code"] == 2
    usage = cli("run", "--json")  # argparse's own refusal: no payload given
    assert usage.returncode == 2 and "payload" in json.loads(usage.stdout)["error"]["cause"]
    no_schedule = cli("schedule", "run", "nosuch", "--file", str(REPO / "schedules.example.toml"))
    assert no_schedule.returncode == 2
    assert "landmarks-hourly, landmarks-nightly" in no_schedule.stderr


def test_empty_store_and_status_filters(tmp_path: Path) -> None:
    empty = cli("runs", "list", env={"ORCHESTRATOR_HOME": str(tmp_path)})
    assert empty.returncode == 0 and empty.stdout == ""
    assert empty.stderr.startswith("orchestrator: no runs in ")
    running = cli("runs", "list", "--status", "running", "--json")
    assert running.returncode == 0 and isinstance(json.loads(running.stdout), list)


def test_logs_full_and_follow(two_runs: list[str], no_leftovers) -> None:
    short = cli("runs", "logs", two_runs[0], env=PIPED).stdout
    full = cli("runs", "logs", two_runs[0], "--full", env=PIPED).stdout
    code_line = 'tower = json.loads(lookup_landmark(name="Eiffel Tower"))'
    assert code_line in full and code_line not in short
    assert "KeyError: 'year'" in full
    assert not re.search(r"(answered|error|step \d+.*): None", short + full)  # never Python's None
    assert max(len(line) for line in short.splitlines()) < 200

    proc = start_cli("run", str(TEST_PAYLOADS / "sleeper"), "--arg", "seconds=4", "-q")
    try:

        def live() -> str | None:
            rows = json.loads(cli("runs", "list", "--status", "running", "--json").stdout)
            return rows[0]["run_id"] if rows else None

        run_id = wait_for(live, timeout=60)
        followed = cli("runs", "logs", run_id, "-f", timeout=60)
        assert followed.returncode == 0
        assert followed.stdout.rstrip().endswith("■ agent finished: success"), followed.stdout
    finally:
        proc.wait(timeout=60)


def test_rm_prune_export(tmp_path: Path, agent_image: str, no_leftovers) -> None:
    home = {"ORCHESTRATOR_HOME": str(tmp_path / "home")}
    ids = [
        json.loads(cli("run", "research_team", "--json", env=home).stdout)["run_id"]
        for _ in range(2)
    ]
    archive = cli("runs", "export", ids[0], "-o", str(tmp_path), "--json", env=home)
    path = Path(json.loads(archive.stdout)["path"])
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
    assert {f"{ids[0]}/result.json", f"{ids[0]}/events.jsonl", f"{ids[0]}/index.json"} <= names
    removed = cli("runs", "rm", ids[0][-8:], "--json", env=home)
    assert json.loads(removed.stdout)["removed"] == [ids[0]]
    assert cli("runs", "show", ids[0], env=home).returncode == 2
    assert cli("runs", "prune", "--older-than", "soon", env=home).returncode == 2
    kept = cli("runs", "prune", "--older-than", "1d", "--json", env=home)
    assert json.loads(kept.stdout)["removed"] == []
    dry = cli("runs", "prune", "--older-than", "0s", "--status", "succeeded", "--dry-run", env=home)
    assert ids[1] in dry.stdout and "would remove 1 run(s)" in dry.stderr
    gone = cli("runs", "prune", "--older-than", "0s", "--json", env=home)
    assert json.loads(gone.stdout)["removed"] == [ids[1]]
    assert not (tmp_path / "home" / "runs" / ids[1]).exists()


def test_defaults_precedence_flag_env_config(tmp_path: Path, agent_image: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[defaults]\nmodel = "nosuch:from-config"\n')
    env = {"ORCHESTRATOR_CONFIG": str(config)}
    from_config = cli("run", "research_team", "--json", env=env)
    assert from_config.returncode == 2 and "from-config" in from_config.stdout
    from_env = cli("run", "research_team", "--json", env={**env, "ORCHESTRATOR_MODEL": "mock"})
    assert from_env.returncode == 0, from_env.stdout
    flagged = cli(
        "run",
        "research_team",
        "--model",
        "mock",
        "--json",
        env={**env, "ORCHESTRATOR_MODEL": "nosuch:from-env"},
    )
    assert flagged.returncode == 0, flagged.stdout
    config.write_text('[defaults]\nnetwork = "sideways"\n')
    bad = cli("run", "research_team", env=env)
    assert bad.returncode == 2 and str(config) in bad.stderr and "sideways" in bad.stderr


def test_new_payload_runs_and_validates(tmp_path: Path, agent_image: str, no_leftovers) -> None:
    def here(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ),
        )

    assert here("new", "demo").returncode == 0
    ran = here("run", "demo")
    assert ran.returncode == 0 and ran.stdout.strip() == "100", ran.stderr
    events = ran.stderr
    assert "researcher answered" in events and "[researcher] step 1" in events
    report = json.loads(here("validate", "demo", "--json").stdout)
    assert report["ok"] is True and report["agents"] == ["manager", "researcher"]
    again = here("new", "demo")
    assert again.returncode == 2 and "already exists" in again.stderr
    examples = json.loads(here("examples", "--json").stdout)
    assert {"research_team", "data_analyst"} <= {e["name"] for e in examples}


def test_images_list_shows_only_our_images(docker_client, agent_image: str) -> None:
    """An image built FROM ours inherits its labels; its name says it is someone else's."""
    import io

    other = "cli-test-other-project:1"
    docker_client.images.build(
        fileobj=io.BytesIO(f"FROM {agent_image}\nLABEL other=1\n".encode()), tag=other, rm=True
    )
    try:
        listed = json.loads(cli("images", "list", "--json").stdout)
        tags = {image["tag"] for image in listed}
        assert agent_image in tags and other not in tags
        table = cli("images", "list", env=PIPED).stdout
        assert table.splitlines()[0].split() == ["IMAGE", "KIND", "CREATED", "SIZE", "IN", "USE"]
        assert re.search(r" \d+(\.\d+)? MB ", table), table
    finally:
        docker_client.images.remove(other, force=True)


# --- snapshots -----------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")
NORMALIZE = [
    (re.compile(r"r-\d{8}-\d{6}-[0-9a-f]{12}"), "RUN_ID"),
    (re.compile(r"b-\d{8}-\d{6}-[0-9a-f]+"), "BATCH_ID"),
    (re.compile(r"concurrency \d+"), "concurrency N"),  # from this machine's CPUs and memory
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d)?(Z|[+-]\d\d:\d\d)?"), "TIME"),
    (re.compile(r"\(\d+[smhd] ago\)|\b\d+[smhd] ago\b"), "AGE"),
    (re.compile(r"\b\d+(\.\d+)?s\b"), "N.Ns"),
    (re.compile(r"\d+(\.\d+)? tasks/min"), "N tasks/min"),
    (re.compile(r"orchestrator-agent:[0-9a-f]{12}"), "AGENT_IMAGE"),
    (re.compile(r"/\S*/(runs|batches)/"), r"STORE/\1/"),
    (re.compile(r"[ \t]+"), " "),  # alignment is checked on its own (see aligned())
]


def normalize(text: str) -> str:
    text = ANSI.sub("", text)
    for pattern, replacement in NORMALIZE:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(normalize(text))
    assert path.is_file(), f"no snapshot {path.name}: run with UPDATE_SNAPSHOTS=1 once"
    assert normalize(text) == path.read_text(), f"{name} differs from {path}"


def aligned(table: str) -> None:
    """A plain table: each row's cell starts where its header does (left-aligned columns) or
    ends where it does (right-aligned ones)."""
    header, *rows = table.splitlines()
    spans = [m.span() for m in re.finditer(r"\S+", header)]
    for row in rows:
        row = row.ljust(len(header))
        for start, end in spans:
            left = row[start] != " " and (start == 0 or row[start - 1] == " ")
            right = row[end - 1] != " " and (end >= len(row) or row[end] == " ")
            assert left or right, (header, row)


@pytest.mark.parametrize("mode", ["terminal", "piped"])
def test_snapshots_of_human_output(
    mode: str, tmp_path: Path, docker_client, agent_image: str, no_leftovers
) -> None:
    output = TERMINAL if mode == "terminal" else PIPED
    # The base the agent image was built on, so that no machine-dependent pull is tried.
    base = docker_client.images.get(agent_image).labels["orchestrator.base"]
    env = {"ORCHESTRATOR_HOME": str(tmp_path / "home"), "ORCHESTRATOR_BASE_IMAGE": base, **output}
    ran = cli("run", "research_team", env=env)
    assert ran.returncode == 0, ran.stderr
    check_snapshot(f"run-{mode}", f"stdout:\n{ran.stdout}stderr:\n{ran.stderr}")
    listed = cli("runs", "list", env=env).stdout
    check_snapshot(f"runs-list-{mode}", listed)
    run_id = re.search(r"r-\d{8}-\d{6}-[0-9a-f]{12}", listed).group(0)
    check_snapshot(f"runs-show-{mode}", cli("runs", "show", run_id, env=env).stdout)
    check_snapshot(f"runs-logs-{mode}", cli("runs", "logs", run_id, env=env).stdout)
    schedules = cli("schedule", "list", "--file", str(REPO / "schedules.example.toml"), env=env)
    check_snapshot(f"schedule-list-{mode}", schedules.stdout)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t1", "task": "How many years?", "expected": "48"}) + "\n")
    batch = subprocess.run(
        [sys.executable, "-m", "orchestrator", "batch", "research_team", str(tasks), "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert batch.returncode == 0, batch.stderr
    assert (tmp_path / "batches" / "research_team-tasks" / "results.jsonl").is_file()
    check_snapshot(f"batch-summary-{mode}", batch.stderr)
    if mode == "piped":
        aligned(listed)
        aligned(schedules.stdout)
        assert "\x1b[" not in ran.stderr + listed
    else:
        assert "\x1b[" in listed  # rich's table, on a terminal
        assert "[dim]" not in batch.stderr + ran.stderr  # markup rendered, never shown


def test_build_tool_output_and_repeated_notices_only_with_verbose(docker_client) -> None:
    from orchestrator.backends.docker.base_image import BASE_IMAGE, resolve_base
    from orchestrator.cli import display

    said: list[str] = []
    wanted = "registry.invalid/no-such-base:1"  # a pull that fails at once (no such host)
    assert resolve_base(docker_client, wanted, progress=said.append) == BASE_IMAGE
    assert resolve_base(docker_client, wanted, progress=said.append) == BASE_IMAGE
    notices = [m for m in said if "cannot be pulled here" in m]
    assert len(notices) == 2 and not display.is_detail(notices[0])
    assert display.is_detail(notices[1]) and notices[1].startswith("note: ")
    for line in ("pip: Collecting smolagents", "build: Step 1/17", notices[1]):
        assert not display.shown(line)
    assert display.shown("building orchestrator-agent:abc on orchestrator-base:bookworm")
    display.VERBOSE = True
    try:
        assert display.shown("pip: Collecting smolagents") and display.shown(notices[1])
    finally:
        display.VERBOSE = False


def test_run_reads_the_task_from_stdin(agent_image: str, no_leftovers) -> None:
    ran = cli("run", "research_team", "-", "--json", input="Who wrote Dune?\n", env=PIPED)
    assert ran.returncode == 0, ran.stderr
    run_id = json.loads(ran.stdout)["run_id"]
    (row,) = [r for r in json.loads(cli("runs", "list", "--json").stdout) if r["run_id"] == run_id]
    assert row["task"] == "Who wrote Dune?"
