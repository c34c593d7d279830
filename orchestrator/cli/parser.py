"""The argument parser of the `orchestrator` command: every command group's module adds its
own subcommands, and only the module of the command being run is imported."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ..paths import VERSION
from .common import EPILOG_EXIT


@dataclass(frozen=True)
class Command:
    """A top-level command: its help line, and the functions (`module:function` in
    `orchestrator.cli`) that add its parser. Why not import them all: `orchestrator run` would
    pay for importing batch, schedules and the viewer on every cold run (its cost:
    benchmarks/results/code_figures.md#import-costs-on-the-start-path)."""

    name: str
    help: str
    adders: tuple[str, ...]
    #: The guide that explains it, under docs/ (each command's --help names it).
    guide: str


COMMANDS = (
    Command(
        "run",
        "run a payload, or a smolagents program as written, once in a fresh sandbox",
        ("run:add_run_parser",),
        "docs/guides/running.md",
    ),
    Command(
        "images",
        "build, list and prune sandbox images",
        ("images:add_images_parser",),
        "docs/guides/images.md",
    ),
    Command(
        "runs",
        "read, remove, prune and export run records",
        ("runs:add_runs_parser",),
        "docs/guides/records.md",
    ),
    Command(
        "validate",
        "check a payload or program: metadata, files, and that its agent tree loads (no step runs)",
        ("payload:add_payload_parser",),
        "docs/guides/writing.md",
    ),
    Command(
        "cleanup",
        "remove sandboxes left behind by a crashed orchestrator",
        ("payload:add_cleanup_parser",),
        "docs/guides/failures.md",
    ),
    Command(
        "doctor",
        "check that this host and backend keep the sandbox promises (PASS/FAIL per check)",
        ("doctor:add_doctor_parser",),
        "docs/guides/kernel.md",
    ),
    Command(
        "batch",
        "run every task of a JSONL/CSV file in its own sandbox, scored and resumable",
        ("batch:add_batch_parser", "report:add_batch_verbs", "batch:add_export_verb"),
        "docs/guides/batch.md",
    ),
    Command(
        "schedule",
        "scheduled agent jobs: cron schedules that never overlap",
        ("schedule:add_schedule_parser",),
        "docs/guides/schedules.md",
    ),
    Command(
        "view",
        "browse runs, agent trees, batches and schedules in a local web page",
        ("view:add_view_parser",),
        "docs/guides/viewer.md",
    ),
    Command(
        "new",
        "write a new payload folder (or, --program, a program) that runs as generated",
        ("new:add_new_parser",),
        "docs/guides/writing.md",
    ),
    Command(
        "examples",
        "list the example payloads shipped with the orchestrator",
        ("new:add_examples_parser",),
        "docs/guides/running.md",
    ),
)
HELP = {command.name: command.help for command in COMMANDS}
#: Where the documentation is, for `orchestrator --help`.
DOCS = "docs/ (the documentation site: `mkdocs serve`; each command's page is named in its help)"


class UsageError(Exception):
    """A command line argparse refuses: reported like every other bad input (exit 2, a JSON
    error object under --json) instead of argparse's own exit."""

    exit_code = 2
    fix = "See the command's --help."
    field: str | None = None

    def __init__(self, parser: argparse.ArgumentParser, cause: str) -> None:
        super().__init__(cause)
        self.parser = parser
        self.cause = cause


class Parser(argparse.ArgumentParser):
    """argparse, with every option's default shown in --help and errors raised, not exited."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("formatter_class") in (None, argparse.RawDescriptionHelpFormatter):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; each option's default appended to its help
    unless the help already says it (`default`) or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default in (None, False, [], argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser(
    in_full: Collection[str] | None = None, *, listed: bool = True
) -> argparse.ArgumentParser:
    """The whole parser, or the commands `in_full` in full and the others as their help line
    (enough for `orchestrator --help`, `--version` and argparse's list of choices), or,
    not `listed` (`lists_commands`), without the others at all."""
    parser = Parser(
        prog="orchestrator",
        description="Run whole smolagents multi-agent programs in hardened sandboxes.",
        epilog=f"{EPILOG_EXIT}\n\nDocumentation: {DOCS}.",
    )
    parser.add_argument("--version", action="version", version=f"orchestrator {VERSION}")
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also show build tools' output (pip, docker build) and repeated notices",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=CommandParser)
    for command in COMMANDS:
        if in_full is not None and command.name not in in_full:
            if listed:
                sub.add_parser(command.name, help=command.help)
            continue
        for adder in command.adders:
            module, function = adder.split(":")
            getattr(importlib.import_module(f"{__package__}.{module}"), function)(sub)
        _point_to_guide(sub.choices[command.name], command.guide)
    for leaf in subcommands(parser):  # -v works after the command too: `run -v ...`
        leaf.add_argument(
            "--verbose",
            "-v",
            action="store_true",
            default=argparse.SUPPRESS,
            help="also show build tools' output and repeated notices",
        )
    return parser


def _point_to_guide(parser: argparse.ArgumentParser, guide: str) -> None:
    """End a command's help, and each of its subcommands', with the page that explains it."""
    verbs = getattr(parser, "verbs", {}).values()
    for each in dict.fromkeys([parser, *subcommands(parser), *verbs]):
        line = f"Explained in {guide}."
        each.epilog = f"{each.epilog}\n\n{line}" if each.epilog else line


def commands_named(argv: Sequence[str]) -> list[str]:
    """The command on a command line, if it is one of ours: the first word that is not an
    option (the top-level options take no values)."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    return [word] if word in HELP else []


def lists_commands(argv: Sequence[str]) -> bool:
    """Whether parsing this command line may need the list of commands: unless it names one
    of ours (`commands_named`) with nothing before it but -v, the top-level parser may print
    its help (`-h run`) or refuse what it is given. Each command's help line is a parser of
    its own (their cost: benchmarks/results/code_figures.md#import-costs-on-the-start-path)."""
    for word in argv:
        if word in ("-v", "--verbose"):
            continue
        return word not in HELP
    return True


@dataclass(frozen=True)
class HandOn:
    """Words a command hands on unread: those after its first positional, when `applies` to
    that word (`run PROGRAM --flag`: the program's own sys.argv, as `uv run script.py --flag`
    and `docker run IMAGE --flag` do; the command's own options go before it). A `--` right
    after it is dropped (`run PROGRAM -- --flag` says the same). `dest`: the namespace
    attribute the words go to; `unknown_fix(unknown words, target, applies)`: the fix of an
    option the command does not have, given the word it applies to (an option put before
    it), else the first positional (or None)."""

    applies: Callable[[str], bool]
    dest: str
    unknown_fix: Callable[[list[str], str | None, bool], str]


#: The namespace attribute listing the command's own options among the words handed on
#: (`run PROGRAM --model x`: the program gets `--model x`; the command may say so).
OWN_OPTIONS_HANDED_ON = "own_options_handed_on"


class CommandParser(Parser):
    """A command's parser that may also hold verbs beside its own positionals, as `batch`
    does: `batch report DIR` goes to the `report` parser and `batch PAYLOAD TASKS` keeps
    working (argparse's subparsers would make every first word a verb); and that may hand
    the words after its first positional on unread (`hand_on`, as `run PROGRAM ...` does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.verbs: dict[str, argparse.ArgumentParser] = {}
        self.hand_on: HandOn | None = None

    def add_verb(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        verb = Parser(prog=f"{self.prog} {name}", **kwargs)
        self.verbs[name] = verb
        return verb

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args and args[0] in self.verbs:
            return self.verbs[args[0]].parse_known_args(args[1:], namespace)
        if self.hand_on is None:
            return super().parse_known_args(args, namespace)
        return self._parse_handing_on(list(args or ()), namespace, self.hand_on)

    def _parse_handing_on(
        self, words: list[str], namespace: argparse.Namespace | None, hand_on: HandOn
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse the words up to the first positional, hand the rest on when `hand_on`
        applies to it; an option this command does not have is refused with the fix that
        says where it goes (UsageError)."""
        at = first_positional(self, words)
        first = words[at] if at is not None else None
        handing = first is not None and hand_on.applies(first)
        head, tail = (words, [])
        if at is not None and handing:
            head, tail = words[: at + 1], words[at + 1 :]
        parsed, unknown = super().parse_known_args(head, namespace)
        if unknown:
            later = (w for w in head if not w.startswith("-") and hand_on.applies(w))
            applied = first if handing else next(later, None)  # `run --flag X PROGRAM`
            error = UsageError(self, f"{' '.join(unknown)}: not an option of `{self.prog}`")
            error.fix = hand_on.unknown_fix(unknown, applied or first, applied is not None)
            raise error
        if handing:
            separated = tail[:1] == ["--"]
            setattr(parsed, hand_on.dest, tail[1:] if separated else tail)
            own = [] if separated else own_options(self, tail)
            setattr(parsed, OWN_OPTIONS_HANDED_ON, own)
        return parsed, []


def first_positional(parser: argparse.ArgumentParser, words: Sequence[str]) -> int | None:
    """Where the first positional argument is among `words`, as the parser would read
    them: options and the values they take skipped, the word after `--`. None: no such."""
    at = 0
    while at < len(words):
        word = words[at]
        if word == "--":
            return at + 1 if at + 1 < len(words) else None
        if not word.startswith("-") or word == "-":
            return at
        at += 1 + _values_taken(parser, word)
    return None


def _values_taken(parser: argparse.ArgumentParser, word: str) -> int:
    """How many of the next words the option `word` takes as its values: none when its
    value is in the word (`--opt=V`, `-oV`), or when it is not an option of the parser."""
    if word.startswith("--"):
        name, equals, _ = word.partition("=")
        action = _option(parser, name)
        return 0 if action is None or equals else _arity(action)
    action = _option(parser, word[:2])
    if action is None:
        return 0
    if len(word) > 2:  # `-qv` (flags together: the last one may take a value) or `-oV`
        return _values_taken(parser, "-" + word[2:]) if action.nargs == 0 else 0
    return _arity(action)


def _option(parser: argparse.ArgumentParser, name: str) -> argparse.Action | None:
    """The parser's option of this name, or the one it is the unique prefix of (argparse
    takes `--mod` for `--model`)."""
    actions = parser._option_string_actions
    if name in actions:
        return actions[name]
    if not name.startswith("--"):
        return None
    matches = {actions[o] for o in actions if o.startswith(name) and o.startswith("--")}
    return matches.pop() if len(matches) == 1 else None


def _arity(action: argparse.Action) -> int:
    if action.nargs is None:
        return 1
    return action.nargs if isinstance(action.nargs, int) else 0


def own_options(parser: argparse.ArgumentParser, words: Sequence[str]) -> list[str]:
    """The parser's own option strings among `words`, up to a `--` (as written, `--opt=V`
    as `--opt`)."""
    found = []
    for word in words:
        if word == "--":
            break
        if word.startswith("-") and word.partition("=")[0] in parser._option_string_actions:
            found.append(word.partition("=")[0])
    return found


def subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every command's parser that takes options (leaves, groups and verbs), depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *subcommands(child)]
                for verb in getattr(child, "verbs", {}).values():
                    found += [verb, *subcommands(verb)]
    return found
