"""The run options are declared once (orchestrator/options.py): every declared option reaches
each place it says it applies to (`run` and `batch` flags and their --help, a schedule key, a
tasks row field, the user's defaults: the config file and its variable) as the RunSpec field
it names, `validate` takes its flags from the same declarations, and the generated reference
lists them. A new `Option` is checked here without a new test. No Docker needed."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.batch.tasks import ROW, read_tasks, task_from_row
from orchestrator.cli.common import add_options, check_flags, spec_from_args
from orchestrator.cli.parser import build_parser, subcommands
from orchestrator.cli.payload import VALIDATE_OPTIONS
from orchestrator.defaults import CONFIG, DEFAULTS, OPTIONS, choose_sandbox_runtime, user_default
from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.options import CONCURRENCY, RUN_OPTIONS, USER_DEFAULTS, Option
from orchestrator.options import option as declared_option
from orchestrator.schedules.file import SCHEDULE, load_schedules
from orchestrator.schema import Field
from orchestrator.spec import SETTABLE_LIMITS, RunSpec
from tests.project.test_docs import REFERENCE, sections
from tests.schedules.test_schedules import toml_value

IDS = [o.name for o in RUN_OPTIONS]
USER_IDS = [o.name for o in USER_DEFAULTS]


def sample(option: Option) -> Any:
    """A valid value of `option` other than its default, as a file would hold it."""
    rule = option.rule
    choices = rule.choices() if callable(rule.choices) else rule.choices
    if choices:
        return next(c for c in choices if c != option.default)
    if option.kind is bool:
        return not option.default
    if option.kind in (int, float):
        low = 1 if rule.minimum is None else rule.minimum
        high = low + 1 if rule.maximum is None else rule.maximum
        return option.kind(low + 1 if low + 1 <= high else low)
    if option.kind is list:
        return ["api.example.com"]
    return "sample"  # a string: also a file name (`path` options), a runtime's name


def flag_words(option: Option, value: Any) -> list[str]:
    if option.kind is bool:
        return [option.flag]
    if option.kind is list:
        return [word for item in value for word in (option.flag, str(item))]
    return [option.flag, str(value)]


def as_spec(option: Option, value: Any, base: Path | None = None) -> Any:
    """`value` as the RunSpec field holds it."""
    if option.kind is list:
        return tuple(value)
    if option.path and base is not None:
        return base / value
    return value


def command_parser(command: str) -> argparse.ArgumentParser:
    (found,) = [p for p in subcommands(build_parser()) if p.prog == f"orchestrator {command}"]
    return found


def test_every_option_names_a_runspec_field_and_every_limit_has_one() -> None:
    spec_fields = {f.name for f in dataclasses.fields(RunSpec)}
    assert [o.name for o in RUN_OPTIONS if o.name not in spec_fields] == []
    assert {o.name for o in RUN_OPTIONS if o.limit} == set(SETTABLE_LIMITS)
    assert len(IDS) == len(set(IDS)), "an option is declared twice"
    flags = [o.flag for o in RUN_OPTIONS]
    assert len(flags) == len(set(flags)), "two options share a flag"


@pytest.mark.parametrize("command", ["run", "batch"])
@pytest.mark.parametrize("option", RUN_OPTIONS, ids=IDS)
def test_a_flag_reaches_the_runspec_and_the_help(option: Option, command: str) -> None:
    parser = command_parser(command)
    actions = {a.dest: a for a in parser._actions}
    if command not in option.applies:
        assert option.name not in actions
        return
    assert actions[option.name].option_strings == [option.flag]
    assert option.flag in parser.format_help()
    value = sample(option)
    positionals = ["payload", "tasks.jsonl"] if command == "batch" else ["payload"]
    args = build_parser().parse_args([command, *flag_words(option, value), *positionals])
    spec = spec_from_args(args)
    assert getattr(spec, option.name) == as_spec(option, value)
    unset = spec_from_args(build_parser().parse_args([command, *positionals]))
    if option.variable is None or option.every_run:  # else filled from the user's defaults
        assert getattr(unset, option.name) == option.default


@pytest.mark.parametrize("option", RUN_OPTIONS, ids=IDS)
def test_a_schedule_key_reaches_the_runspec(option: Option, tmp_path: Path) -> None:
    keys = SCHEDULE.fields["limits"].table.fields if option.limit else SCHEDULE.fields
    if "schedule" not in option.applies:
        assert option.name not in keys
        return
    assert keys[option.name] is option.rule
    value = sample(option)
    if option.path:
        (tmp_path / value).write_text("")
    table = {"limits": {option.name: value}} if option.limit else {option.name: value}
    lines = ['[[schedule]]\nname = "s"\ncron = "@hourly"\npayload = "research_team"']
    for key, item in table.items():
        lines.append(f"{key} = {toml_value(item)}")
    path = tmp_path / "schedules.toml"
    path.write_text("\n".join(lines) + "\n")
    (schedule,) = load_schedules(path, check_payloads=False).schedules
    spec = schedule.run_spec()
    assert getattr(spec, option.name) == as_spec(option, value, tmp_path)


@pytest.mark.parametrize("option", RUN_OPTIONS, ids=IDS)
def test_a_tasks_row_field_is_that_tasks_override(option: Option, tmp_path: Path) -> None:
    if "task" not in option.applies:
        assert option.name not in ROW.fields
        with pytest.raises(ValueError, match=f"`{option.name}` is not a known field"):
            task_from_row({"task": "t", option.name: sample(option)}, 1)
        return
    assert ROW.fields[option.name] is option.rule
    value = sample(option)
    assert task_from_row({"task": "t", option.name: value}, 1).overrides == {
        option.name: as_spec(option, value)
    }
    for name in (option.name, *option.aliases):  # a CSV cell is text, read as the type
        cell = json.dumps(value) if option.kind is bool else str(value)
        (tmp_path / "tasks.csv").write_text(f"task,{name}\nt,{cell}\n")
        (task,) = read_tasks(tmp_path / "tasks.csv").tasks
        assert task.overrides == {option.name: as_spec(option, value)}


def user_set_value(option: Option) -> Any:
    """What a run gets from the user's defaults for `option`, read as the run reads it: a
    command's flags (`spec_from_args`), the runner's (`every_run`), a batch's concurrency."""
    if option is CONCURRENCY:
        from orchestrator.cli.batch import batch_spec_from_args

        args = build_parser().parse_args(["batch", "research_team", "tasks.jsonl"])
        return batch_spec_from_args(args).concurrency
    if option.every_run:
        assert option.name == "sandbox_runtime", "a new every_run option: read it here"
        return choose_sandbox_runtime(None, None)
    args = build_parser().parse_args(["run", "research_team"])
    return getattr(spec_from_args(args), option.name)


@pytest.mark.parametrize("option", USER_DEFAULTS, ids=USER_IDS)
def test_a_user_default_is_read_from_the_config_file_and_its_variable(
    option: Option, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An option that applies to `defaults` is a key of the config file's `[defaults]` and
    the variable its declaration names, under the option's own rule; the variable wins."""
    assert DEFAULTS.fields[option.name] is option.rule
    assert OPTIONS[option.name] == option.variable == f"ORCHESTRATOR_{option.name.upper()}"
    assert f"${option.variable}" in option.help_text()  # --help says where else it is read
    for other in USER_DEFAULTS:
        monkeypatch.delenv(str(other.variable), raising=False)
    value = sample(option)
    config = tmp_path / "config.toml"
    config.write_text(f"[defaults]\n{option.name} = {toml_value(value)}\n")
    monkeypatch.setenv("ORCHESTRATOR_CONFIG", str(config))
    assert user_default(option.name) == (value, str(config))
    assert user_set_value(option) == value
    config.write_text("")  # the variable alone, as text
    monkeypatch.setenv(str(option.variable), str(value))
    assert user_default(option.name) == (value, f"${option.variable}")
    assert user_set_value(option) == value


def test_only_declared_options_are_user_defaults() -> None:
    assert set(CONFIG.fields["defaults"].table.fields) == {o.name for o in USER_DEFAULTS}
    assert [o for o in RUN_OPTIONS if o.variable is not None] == [
        o for o in USER_DEFAULTS if o is not CONCURRENCY
    ]
    flags = [action.dest for action in command_parser("batch")._actions]
    assert CONCURRENCY.name in flags and CONCURRENCY.name not in IDS


def test_validate_takes_the_declared_flags() -> None:
    """`validate` reads the declarations of the run options it takes: the same flag, rule and
    help as `run`'s, never its own copy."""
    validate = {a.dest: a for a in command_parser("validate")._actions}
    run = {a.dest: a for a in command_parser("run")._actions}
    for name in VALIDATE_OPTIONS:
        declared = declared_option(name)
        assert validate[name].option_strings == run[name].option_strings == [declared.flag]
        assert validate[name].help == run[name].help == declared.help_text()
    args = build_parser().parse_args(
        ["validate", "research_team", "--backend", "docker", "--env-file", "x.env"]
    )
    spec = spec_from_args(args)
    assert (spec.backend, spec.env_file, spec.allow_dangerous_imports) == ("docker", "x.env", False)


def test_every_option_is_in_the_generated_reference() -> None:
    cli = sections(REFERENCE.cli_reference())
    files = sections(REFERENCE.files_reference())
    batch_help = command_parser("batch").format_help()
    for option in RUN_OPTIONS:
        row = cli["Run options"]
        assert f"| `{option.name}` |" in row, option.name
        for command in ("run", "batch"):
            assert (f"`{option.flag}`" in cli[f"orchestrator {command}"]) == (
                command in option.applies
            ), (command, option.name)
        in_schedule = f"| `{option.key}` |" in files["A [[schedule]] table"]
        assert in_schedule == ("schedule" in option.applies), option.name
        in_row = f"| `{option.name}` |" in files["A tasks row"]
        assert in_row == ("task" in option.applies), option.name
        (line,) = [line for line in row.splitlines() if line.startswith(f"| `{option.name}` |")]
        assert (f"| `{option.variable}` |" in line) == (option.variable is not None), line
    for option in USER_DEFAULTS:
        assert f"| `defaults.{option.name}` |" in files["The config file"], option.name
        assert f"| `{option.variable}` |" in cli["Environment variables"], option.name
        if "task" in option.applies:  # the batch help's list of what a tasks row may set
            assert option.name in batch_help, option.name


def test_bad_flag_values_are_all_named_with_the_fix(tmp_path: Path) -> None:
    """A flag the parser cannot read is argparse's error (exit 2); a limit out of range is
    the runner's, naming every one with the command line as its source."""
    from orchestrator.lifecycle.runner import prepare

    args = build_parser().parse_args(["run", "--timeout", "0", "--pids", "1", "research_team"])
    with pytest.raises(OrchestratorError) as caught:
        prepare(spec_from_args(args))
    assert caught.value.exit_code == 2
    assert "command line: 2 problems" in caught.value.cause
    assert "limit `timeout_seconds` is 0.0, out of range" in caught.value.cause


def test_a_flag_out_of_its_options_range_is_named_with_the_fix() -> None:
    """An option with a range (not a limit, which the runner checks) is checked as its flag
    is read: every bad flag named, with the fix, exit 2; a value of the wrong type is
    argparse's error."""
    options = [
        Option("level", Field(int, minimum=-20, maximum=19, fix="Use -20 to 19."), help="a"),
        Option("ratio", Field(float, minimum=0, maximum=1), help="b"),
    ]
    parser = argparse.ArgumentParser()
    add_options(parser, options)
    check_flags(parser.parse_args(["--level", "19", "--ratio", "0.5"]), options)
    with pytest.raises(ConfigError) as caught:
        check_flags(parser.parse_args(["--level", "40", "--ratio", "2"]), options)
    assert caught.value.exit_code == 2
    assert caught.value.cause == (
        "command line: 2 problems:\n"
        "  - `--level` is 40, out of range. Use -20 to 19.\n"
        "  - `--ratio` is 2.0, out of range. Use a number from 0 to 1."
    )
    with pytest.raises(ConfigError) as caught:
        check_flags(parser.parse_args(["--level", "-21"]), options[:1])
    assert (caught.value.cause, caught.value.fix) == (
        "command line: `--level` is -21, out of range.",
        "Use -20 to 19.",
    )
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--level", "x"])
    assert exited.value.code == 2
