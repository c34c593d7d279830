"""What every command shares: the run options, their mapping to a RunSpec, signals."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection, Iterable, Iterator
from typing import Any

from ..defaults import fill
from ..errors import ConfigError, OrchestratorError, Problem
from ..options import RUN_OPTIONS, Option, Place, options_for
from ..schema import check_value
from ..spec import EXIT_CODES, RunSpec

EPILOG_EXIT = (
    "Exit codes: "
    + ", ".join(f"{c} {s}" for s, c in EXIT_CODES.items())
    + (", 2 bad input (nothing started).")
)


class LazyChoices(Collection[str]):
    """An option's allowed values, read when asked: a name is found with the option's quick
    test when it has one (a built-in backend, without reading the entry points)."""

    def __init__(self, option: Option) -> None:
        self.option = option

    def _all(self) -> Collection[str]:
        choices = self.option.rule.choices
        return choices() if callable(choices) else choices or ()

    def __contains__(self, name: object) -> bool:
        if self.option.known is not None:
            return isinstance(name, str) and self.option.known(name)
        return name in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class LazyOption(argparse.Action):
    """A run option whose choices and help are read when asked (a name given, --help,
    completion, the reference), not when the parser is built: `--backend` lists every
    backend, and a run that names none never reads the installed packages' entry points
    (`registry.backend_entries`; its cost:
    benchmarks/results/code_figures.md#import-costs-on-the-start-path) for it."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        self.option: Option = kwargs.pop("option")
        kwargs.setdefault("metavar", "NAME")  # argparse would list the choices to check it
        super().__init__(option_strings, dest, **kwargs)

    @property
    def choices(self) -> LazyChoices:
        return LazyChoices(self.option)

    @choices.setter
    def choices(self, _value: Any) -> None:
        """Always the option's (argparse sets None as it makes the action)."""

    @property
    def help(self) -> str:
        return self.option.help_text()

    @help.setter
    def help(self, _value: Any) -> None:
        """Always the option's (argparse sets None as it makes the action)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


def add_run_options(p: argparse.ArgumentParser, command: Place) -> None:
    """The run options (`options.RUN_OPTIONS`) that apply to `command` (`run`, `batch`)."""
    add_options(p, options_for(command))


def add_options(p: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """A flag for each option, its value kept under the option's name."""
    for option in options:
        p.add_argument(option.flag, dest=option.name, **_argument(option))


def _argument(option: Option) -> dict[str, Any]:
    """How argparse reads `option`'s flag: a bool flag turns its default over, a list one
    repeats, a number is converted (its range is checked in `spec_from_args`)."""
    choices = option.rule.choices
    if callable(choices):
        return {"action": LazyOption, "option": option, "metavar": option.metavar}
    kind = option.kind
    if kind is bool:
        return {
            "action": "store_false" if option.default else "store_true",
            "help": option.help_text(),
        }
    found: dict[str, Any] = {"help": option.help_text(), "metavar": option.metavar}
    if kind is list:
        found.update(action="append", default=[])
    elif kind in (int, float):
        found["type"] = kind
    if choices is not None:
        found["choices"] = list(choices)
    return found


def spec_from_args(args: argparse.Namespace, **overrides: Any) -> RunSpec:
    """The RunSpec of a command's run options (`overrides` win), the user's defaults filled
    in; raises ConfigError naming every flag whose value breaks its option's rule."""
    fields: dict[str, Any] = dict(
        payload=getattr(args, "payload", None),
        task=getattr(args, "task", None),
        additional_args=parse_kv_args(getattr(args, "arg", [])),
    )
    given = [o for o in RUN_OPTIONS if hasattr(args, o.name)]  # the command's options
    check_flags(args, given)
    for option in given:
        value = getattr(args, option.name)
        fields[option.name] = option.default if value is None else option.value(value)
    fields.update(overrides)
    # The user's defaults of the command's options; an `every_run` one the runner applies
    # (for the Python API's runs and schedules too).
    users = [o.name for o in given if "defaults" in o.applies and not o.every_run]
    fields.update(fill({name: fields[name] for name in users}))
    return RunSpec(**fields)


def check_flags(args: argparse.Namespace, options: Iterable[Option]) -> None:
    """Raise ConfigError (exit 2) naming every flag whose value breaks its option's rule
    (a range, a pattern), with the fix. argparse checked each value's type and choices; the
    runner checks the limits and hosts (`checked_by_run`), with the payload's own."""
    problems: list[Problem] = []
    for option in options:
        value = getattr(args, option.name)
        if value is not None and not option.checked_by_run and option.rule.choices is None:
            check_value(option.rule, value, option.flag, problems)
    if problems:
        raise ConfigError.of_problems(
            "command line",
            [p.replace(message=f"`{p.field}` {p.message}") for p in problems],
            "Fix the options named above.",
        )


def parse_kv_args(items: list[str]) -> dict[str, Any] | None:
    if not items:
        return None
    result: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise OrchestratorError(
                f"--arg {item!r} is not KEY=VALUE.", "Write --arg a=3 or --arg name='\"x\"'."
            )
        try:
            result[key] = json.loads(raw)
        except ValueError as exc:
            if raw.lstrip()[:1] in ("[", "{", '"'):  # meant as JSON: never a silent string
                raise OrchestratorError(
                    f"--arg {key}: {raw!r} is not valid JSON ({exc}).",
                    f"Fix the JSON (e.g. --arg '{key}=[1, 2]'), or quote it whole to pass "
                    f"a string: --arg '{key}=\"...\"'.",
                ) from None
            result[key] = raw  # a bare word is a string: --arg name=alice
    return result


def tidy_store() -> None:
    """Close runs whose orchestrator process died (see `cleanup.tidy`), saying so on stderr:
    every command that opens the store does this first."""
    from ..lifecycle.cleanup import closed_line, tidy

    def warn(message: str) -> None:
        print(f"orchestrator: warning: {message}", file=sys.stderr)

    for run_id in tidy(warn=warn):
        print(f"orchestrator: {closed_line(run_id)}", file=sys.stderr)
