"""The command line explains itself: every command's --help runs, every option has help text
(and shows its default), the README's command reference lists exactly the commands there are,
--version answers, and shell completion completes; a run's start imports only what it needs.
No Docker needed, but for that start up to its sandbox."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.parser import HELP, build_parser, commands_named, lists_commands, subcommands
from tests.conftest import REPO, cli

PARSER = build_parser()


def command_paths(parser: argparse.ArgumentParser = PARSER, prefix: tuple[str, ...] = ()):
    """('run',), ('runs', 'list'), ... for every command and action."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*prefix, name)
                yield from command_paths(child, (*prefix, name))
                for verb in getattr(child, "verbs", {}):  # `batch report`, `batch rescore`
                    yield (*prefix, name, verb)


COMMANDS = sorted(set(command_paths()))


def test_every_option_and_command_has_help_text() -> None:
    missing = []
    for parser in [PARSER, *subcommands(PARSER)]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [
                    f"{parser.prog} {choice.dest}"
                    for choice in action._choices_actions
                    if not choice.help
                ]
            elif not action.help:
                missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"no help text: {missing}"


def test_defaults_are_shown_in_help() -> None:
    """An option with a default says it: in its own words or as the appended `(default: X)`."""
    unsaid = []
    for parser in subcommands(PARSER):
        formatter = parser._get_formatter()
        for action in parser._actions:
            trivial = action.default in (None, False, [], argparse.SUPPRESS)
            if action.option_strings and not trivial:
                if "default" not in (formatter._get_help_string(action) or "").lower():
                    unsaid.append(f"{parser.prog} {action.option_strings[0]}")
    assert not unsaid, f"default not shown: {unsaid}"


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_command_help_runs(path: tuple[str, ...]) -> None:
    parser = PARSER
    for name in path:
        verbs = getattr(parser, "verbs", {})
        parser = (
            verbs[name]
            if name in verbs
            else next(
                a.choices[name]
                for a in parser._actions
                if isinstance(a, argparse._SubParsersAction)
            )
        )
    text = parser.format_help()
    assert text.startswith(f"usage: orchestrator {' '.join(path)}")
    assert "--help" in text


def test_help_and_version_from_the_real_command() -> None:
    out = cli("--help")
    assert out.returncode == 0 and "commands:" in out.stdout
    version = cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"orchestrator \d+\.\d+\.\d+\n", version.stdout)
    listed = cli("runs", "list", "--help")
    assert "--limit LIMIT" in listed.stdout and "(default: 20)" in listed.stdout


IMPORTED_BY = """
import sys
from orchestrator.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(" ".join(sorted(m for m in sys.modules if m.startswith("orchestrator."))))
"""


@pytest.mark.parametrize(
    ("argv", "loaded", "not_loaded"),
    [
        (["run", "--help"], "orchestrator.cli.run", ("batch", "schedules", "view", "cli.batch")),
        (["--version"], "orchestrator.cli.parser", ("cli.run", "batch", "schedules", "view")),
        (["batch", "--help"], "orchestrator.cli.batch", ("schedules", "view", "cli.schedule")),
    ],
)
def test_a_command_imports_only_its_own_module(
    argv: list[str], loaded: str, not_loaded: tuple[str, ...]
) -> None:
    """Start-up time is part of every cold run: `orchestrator run` does not import batch,
    schedules or the viewer (each command's module is imported only when it runs)."""
    out = subprocess.run(
        [sys.executable, "-c", IMPORTED_BY, *argv], capture_output=True, text=True, cwd=REPO
    )
    modules = out.stdout.strip().splitlines()[-1].split()
    assert loaded in modules, out.stdout + out.stderr
    for name in not_loaded:
        assert f"orchestrator.{name}" not in modules, f"{argv} imported orchestrator.{name}"


@pytest.mark.parametrize(
    ("argv", "listed"),
    [
        (["run", "payload", "--json"], False),
        (["-v", "--verbose", "run", "payload"], False),
        (["-h", "run"], True),  # the top-level help lists every command
        (["--bogus", "run"], True),  # refused by the top-level parser
        (["bogus"], True),  # argparse's list of choices
        ([], True),
    ],
)
def test_a_command_named_builds_no_other_commands_parser(argv: list[str], listed: bool) -> None:
    """Not even their help lines (about 2 ms of every cold run), unless the top-level parser
    may list them: every one is there then, as before."""
    parser = build_parser(commands_named(argv), listed=lists_commands(argv))
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(commands.choices) == (sorted(HELP) if listed else commands_named(argv))


#: What a run's start must not import: every module imported before its sandbox is created
#: is paid for by every cold run (benchmarks/host_start.py measures it). The Docker SDK is
#: the one heavy import it needs; these it does not.
NOT_BEFORE_THE_SANDBOX = (
    "rich",  # a quiet or piped run prints plain lines
    "smolagents",  # the agent runs in the sandbox
    "litellm",
    "pyarrow",  # batches' Parquet
    "e2b",
    "opentelemetry",  # traces are written after the run
    "openinference",
    "orchestrator.batch",
    "orchestrator.view",
    "orchestrator.schedules",
    "orchestrator.cluster",
    "orchestrator.backends.e2b",
    "orchestrator.backends.docker.egress",  # a run without a network or a model gateway
    "orchestrator.backends.docker.gateway",
    "orchestrator.backends.docker.interceptor",
    "concurrent.futures",  # the gateway's start beside the sandbox's
    "orchestrator.backends.docker.runsc_direct",  # a run on runc or on gVisor through the engine
    "platform",  # (imported by runsc_direct)
)


START_OF_A_RUN = """
import sys
from orchestrator.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(" ".join(sorted(sys.modules)))
"""


def test_a_run_imports_nothing_heavy_before_its_sandbox(tmp_path: Path) -> None:
    """The whole start of `orchestrator run` on a payload, to the engine: no engine answers
    here, so the run stops where it would ask it for its image, with everything before that
    (parsing, the payload's checks, the model, the record, the backend) imported."""
    payload = REPO / "tests" / "payloads" / "batch_math"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")},
        "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock",
        "ORCHESTRATOR_HOME": str(tmp_path / "home"),
    }
    argv = ["run", str(payload), "--arg", "a=6", "--quiet", "--sandbox-runtime", "runc"]
    out = subprocess.run(
        [sys.executable, "-c", START_OF_A_RUN, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert "Cannot reach the Docker engine" in out.stderr, out.stderr  # it got that far
    modules = set(out.stdout.split())
    assert {"docker", "orchestrator.lifecycle.prepared", "orchestrator.records.record"} <= modules
    heavy = not_before_the_sandbox(modules)
    assert not heavy, f"a run's start imported {sorted(heavy)}"


def not_before_the_sandbox(modules: set[str], *names: str) -> list[str]:
    """Those of `modules` that NOT_BEFORE_THE_SANDBOX or `names` name, or are part of."""
    unwanted = (*NOT_BEFORE_THE_SANDBOX, *names)
    return sorted(m for m in modules if m in unwanted or m.split(".")[0] in unwanted)


UP_TO_THE_CREATE_CALL = """
import sys
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.cli import main

create = DockerBackend.create
imported = []

def noting_imports(self, spec, progress):
    imported.extend(sys.modules)
    return create(self, spec, progress)

DockerBackend.create = noting_imports
main(sys.argv[1:])
print(" ".join(sorted(imported)))
"""


def test_a_run_up_to_its_sandbox_imports_only_what_it_needs(
    docker_client, agent_image: str, no_leftovers
) -> None:
    """The same, with the engine: everything imported before the sandbox's create call (its
    image checked too), on the suite's runtime. Not a payload's requirements' constraints
    either (images/constraints.py: only a payload image reads them)."""
    base = docker_client.images.get(agent_image).labels["orchestrator.base"]
    payload = REPO / "tests" / "payloads" / "batch_math"
    argv = ["run", str(payload), "mul", "--arg", 'op="mul"', "--arg", "a=6", "--arg", "b=7"]
    out = subprocess.run(
        [sys.executable, "-c", UP_TO_THE_CREATE_CALL, *argv, "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "ORCHESTRATOR_BASE_IMAGE": base},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    answer, modules = out.stdout.splitlines()[-2:]
    assert answer == "42", out.stdout
    imported = set(modules.split())
    assert {"docker", "orchestrator.backends.docker.images"} <= imported
    unneeded = not_before_the_sandbox(imported, "orchestrator.images.constraints")
    assert not unneeded, f"a run's start imported {unneeded}"


COLLECTOR_AT_EXIT = """
import atexit, gc, sys
from orchestrator import cli

before = sum(generation["collections"] for generation in gc.get_stats())

def said():
    collections = sum(generation["collections"] for generation in gc.get_stats()) - before
    print(gc.isenabled(), gc.get_freeze_count(), collections)

atexit.register(said)
sys.argv = ["orchestrator", *sys.argv[1:]]
cli.command()
"""


def test_a_runs_start_up_runs_no_garbage_collection(tmp_path: Path) -> None:
    """`orchestrator run`'s start-up (its imports, the Docker SDK's, the payload's checks)
    makes objects that live as long as the process and hardly any garbage: the collector is
    held off until the run is checked (some 60 collections less, and their CPU in every cold
    run), then what was made is frozen and the collector runs again."""
    env = {
        **os.environ,
        "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock",  # the run stops at the engine
        "ORCHESTRATOR_HOME": str(tmp_path / "home"),
    }
    payload = str(REPO / "tests" / "payloads" / "batch_math")
    argv = ["run", payload, "--arg", "a=6", "--quiet", "--sandbox-runtime", "runc"]
    out = subprocess.run(
        [sys.executable, "-c", COLLECTOR_AT_EXIT, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert "Cannot reach the Docker engine" in out.stderr, out.stderr
    enabled, frozen, collections = out.stdout.split()
    assert enabled == "True", "the collector was left off"
    assert int(frozen) > 10_000, "the start-up's objects were not frozen"
    assert int(collections) < 10, f"{collections} collections in the start-up"


def test_readme_command_reference_matches_the_parser() -> None:
    """The README's table names every command group and action, and no other."""
    readme = (REPO / "README.md").read_text()
    table = readme.split("<!-- commands:", 1)[1].split("<!-- /commands -->", 1)[0]
    documented: set[tuple[str, ...]] = set()
    for cell in re.findall(r"^\| `orchestrator ([^`]+)`", table, flags=re.M):
        words = [w for w in cell.split() if re.fullmatch(r"[a-z][a-z/-]*", w)]
        head, *rest = words
        documented.add((head,))
        for action in rest[0].split("/") if rest else []:
            documented.add((head, action))
    assert documented == set(COMMANDS), (
        f"missing from README: {sorted(set(COMMANDS) - documented)}; "
        f"not commands: {sorted(documented - set(COMMANDS))}"
    )


def test_shell_completion_completes_commands_and_choices(tmp_path: Path) -> None:
    from orchestrator.records.store import Store

    Store(tmp_path).create_run("r-20260101-000000-abcdef012345", status="succeeded")

    def complete(line: str) -> set[str]:
        """What bash's completion hook gets: argcomplete writes the words on fd 8."""
        env = {
            **os.environ,
            "ORCHESTRATOR_HOME": str(tmp_path),
            "_ARGCOMPLETE": "1",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
            "_ARGCOMPLETE_IFS": "\n",
            "_ARGCOMPLETE_SHELL": "bash",
        }
        command = f"{shlex.quote(sys.executable)} -m orchestrator 8>&1 9>/dev/null"
        proc = subprocess.run(
            ["bash", "-c", command], env=env, cwd=REPO, capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 0, proc.stderr
        return {w.strip() for w in proc.stdout.split("\n") if w.strip()}

    assert {"run", "runs"} <= complete("orchestrator ru")
    assert {"running", "succeeded"} <= complete("orchestrator runs list --status ")
    # a RUN completes with run ids, not file names
    assert complete("orchestrator runs logs r-2026") == {"r-20260101-000000-abcdef012345"}
    assert complete("orchestrator runs show @") == {"@latest"}


def test_inputs_a_user_mistypes_are_refused_with_the_fix() -> None:
    """Malformed `--arg` JSON is never a silent string; `--limit -1` is no limit a person
    means; `run PAYLOAD -` with nothing on stdin has no task. Exit 2, nothing started."""
    bad_json = cli("run", "research_team", "--arg", "a=[1,2", "--json")
    assert bad_json.returncode == 2, bad_json.stderr
    error = json.loads(bad_json.stdout)["error"]
    assert "not valid JSON" in error["cause"] and "--arg 'a=[1, 2]'" in error["fix"], error
    limit = cli("runs", "list", "--limit", "-1")
    assert limit.returncode == 2 and "below 0" in limit.stderr, limit.stderr
    empty = cli("run", "research_team", "-", input="\n")
    assert empty.returncode == 2 and "stdin holds no text" in empty.stderr, empty.stderr
    typo = cli("run", "research_tam")  # a payload name, as handles are: the nearest named
    assert typo.returncode == 2 and "Did you mean research_team?" in typo.stderr, typo.stderr


ASK = REPO / "tests" / "programs" / "ask.py"


def test_the_words_after_a_programs_path_are_the_programs() -> None:
    """As after `uv run script.py` or `docker run IMAGE`: orchestrator's options go before
    the program's path, every word after it is the program's sys.argv[1:] (orchestrator's
    option names too, listed so that `run` can say so); a `--` right after it is dropped."""
    parser = build_parser(["run"])
    given = parser.parse_args(["run", "--model", "mock", str(ASK), "--question", "X", "-q"])
    assert (given.model, given.quiet, given.args) == ("mock", False, ["--question", "X", "-q"])
    assert given.own_options_handed_on == ["-q"]
    after = parser.parse_args(["run", str(ASK), "--", "--model", "m", "--", "x"])
    assert (after.model, after.args) == (None, ["--model", "m", "--", "x"])
    assert after.own_options_handed_on == []
    quoted = parser.parse_args(["run", "--json", "--", str(ASK), "--", "-a"])
    assert (quoted.json, quoted.payload, quoted.args) == (True, str(ASK), ["-a"])
    # A payload folder keeps orchestrator's options anywhere, its task among them.
    payload = parser.parse_args(["run", "research_team", "Who?", "--model", "mock"])
    assert (payload.args, payload.model) == (["Who?"], "mock")


def test_an_option_in_the_wrong_place_says_where_it_goes() -> None:
    """An option `run` does not have: before a program's path, it goes after; after a payload
    folder, a payload takes none of its own. Exit 2 before anything starts."""
    before = cli("run", "--question", "Who?", str(ASK))
    assert before.returncode == 2, before.stderr
    assert "--question: not an option of `orchestrator run`" in before.stderr
    assert f"put it after the path: orchestrator run [OPTIONS] {ASK} --question" in before.stderr
    folder = cli("run", "research_team", "--question", "Who?", "--json")
    assert folder.returncode == 2, folder.stderr
    error = json.loads(folder.stdout)["error"]
    assert error["cause"] == "--question Who?: not an option of `orchestrator run`", error
    assert error["fix"].startswith("research_team is a payload folder, which takes no options")
    assert 'orchestrator run research_team "your task"' in error["fix"], error


def test_every_message_line_has_the_prefix_and_an_empty_prune_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log warning (the base image fallback, which `cleanup` and
    `images prune` meet with no progress line) comes out as `orchestrator: ...`, a repeated
    one only with -v; `images prune` with nothing to prune says so (before: a bare `note:
    ...` line, and no output at all)."""
    import logging

    from orchestrator.cli import images, main

    class Nothing:
        def prune_images(self, *, dry_run: bool = False) -> list[str]:
            log = logging.getLogger("orchestrator.backends.docker.base_image")
            log.warning("base image x is not available; falling back to y")
            log.warning("note: base image x is not available (said before)")
            return []

    from orchestrator.cli import display

    monkeypatch.setattr(images, "backend_that_can", lambda *a: Nothing())
    monkeypatch.setattr(display, "VERBOSE", False)  # main sets them: restored after
    monkeypatch.setattr(logging.getLogger("orchestrator"), "handlers", [])
    monkeypatch.setattr(logging.getLogger("orchestrator"), "propagate", True)
    assert main(["images", "prune", "--dry-run"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "orchestrator: base image x is not available; falling back to y",
        "orchestrator: nothing to prune: every orchestrator image is current or in use",
    ], err
    assert main(["images", "prune", "--dry-run", "-v"]) == 0
    assert "orchestrator: note: base image x" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"FORCE_COLOR": "1"},
        {"FORCE_COLOR": ""},
        {"TTY_COMPATIBLE": "1"},
        {"TTY_COMPATIBLE": "0", "FORCE_COLOR": "1"},
        {"TTY_COMPATIBLE": "2", "FORCE_COLOR": "1"},
    ],
)
def test_terminal_output_is_decided_by_riches_rule_without_rich(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`is_terminal` writes out rich's rule so that a piped run never imports rich; on a pipe
    and on a terminal (a pty) it answers what rich itself answers, whatever the variables."""
    from rich.console import Console

    from orchestrator.cli.output import is_terminal

    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    master, slave = os.openpty()
    read_end, write_end = os.pipe()
    with open(slave, "w") as tty, open(write_end, "w") as pipe:
        for stream in (tty, pipe):
            assert is_terminal(stream) == Console(file=stream).is_terminal, (env, stream)
    os.close(master)
    os.close(read_end)


def test_a_piped_run_display_never_imports_rich() -> None:
    """A run whose output goes to a pipe (a script, cron, a batch driver) prints plain lines:
    its start-up pays for no rich import (35 ms of CPU)."""
    code = (
        "import sys, io; from orchestrator.cli.display import RunDisplay; "
        "d = RunDisplay(stream=io.StringIO()); d.progress('building'); d.stop(); "
        "assert not [m for m in sys.modules if m.startswith('rich')], 'rich imported'"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr


def test_a_run_on_a_built_in_backend_reads_no_entry_points() -> None:
    """Reading every installed package's entry points costs a cold run 15 ms of CPU: a run on
    a built-in backend (its options parsed, its backend found) reads none; its --help, which
    names every backend, reads them then."""
    code = """
from orchestrator import registry
from orchestrator.backends import backend_class, backend_name
from orchestrator.cli.parser import build_parser, commands_named

def reads():
    return registry.backend_entries.cache_info().currsize

parser = build_parser(commands_named(["run"]))
parser.parse_args(["run", "x"])
backend_class(backend_name(None))
parser.parse_args(["run", "x", "--backend", "e2b"])
assert reads() == 0, "entry points read"
(run,) = [a.choices["run"] for a in parser._actions if hasattr(a, "_name_parser_map")]
assert "where sandboxes run: docker" in " ".join(run.format_help().split())
assert reads() == 1, "the help named no registered backend"
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr


LEAVING = """
import atexit, sys, threading
from orchestrator import cli

class Teardown:
    def __del__(self):
        sys.stderr.write("interpreter shutdown\\n")

kept = Teardown()
atexit.register(lambda: sys.stderr.write("atexit ran\\n"))
if sys.argv[2] == "thread":
    stop = threading.Event()
    threading.Thread(target=stop.wait, args=(2,)).start()

def main(argv=None):
    cli._done_with_process = sys.argv[1] == "leaves"
    print("result")
    return 3

cli.main = main
cli.command()
"""


@pytest.mark.parametrize(
    ("says", "thread", "shut_down"),
    [("leaves", "none", False), ("stays", "none", True), ("leaves", "thread", True)],
)
def test_a_command_done_with_its_process_leaves_without_the_interpreters_shutdown(
    says: str, thread: str, shut_down: bool
) -> None:
    """`orchestrator run` leaves once its record is closed (the shutdown's teardown and the
    store's checkpoint cost a cold run 0.08-0.9 s after its result); its output and atexit's
    functions are not lost, the exit code is the command's, and a command that does not say
    so, or a thread still running, gets the interpreter's whole shutdown."""
    done = subprocess.run(
        [sys.executable, "-c", LEAVING, says, thread], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 3 and done.stdout == "result\n", done
    assert "atexit ran" in done.stderr
    assert ("interpreter shutdown" in done.stderr) == shut_down, done.stderr
