"""`orchestrator run`: one payload, one fresh sandbox, live events."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from ..spec import RunResult
from . import signals
from .common import (
    EPILOG_EXIT,
    add_run_options,
    spec_from_args,
    tidy_store,
)
from .output import human_duration, print_json, say
from .parser import HELP, OWN_OPTIONS_HANDED_ON, HandOn

if TYPE_CHECKING:
    from ..lifecycle.prepared import PreparedRun


def add_run_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help=HELP["run"],
        description="Run a payload (a folder with manifest.toml) on a task, or a smolagents "
        "program as written (a .py file, or a folder with __main__.py or main.py), in one "
        "fresh, hardened sandbox; stream its events and keep a run record. A program's "
        "models keep its choices and reach their endpoint only through the run's model "
        "gateway, which holds the key on the host.",
        epilog="A program's own arguments and options go after its path, as they would "
        "after `python program.py`: orchestrator's options go before the path (everything "
        "after it is the program's sys.argv[1:]; a `--` right after the path is dropped). A "
        "payload folder takes one task, and orchestrator's options anywhere.\n\n"
        "Examples:\n"
        "  orchestrator run agent_payloads/research_team --model mock\n"
        "  HF_TOKEN=... orchestrator run fib_team.py\n"
        "  orchestrator run --api-base http://127.0.0.1:8080/v1 my_script.py input.csv\n"
        '  orchestrator run --model mock ask.py --question "Who wrote Dune?"\n' + EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "payload",
        help="a payload folder (holding manifest.toml), a program (a .py file, or a folder "
        "with __main__.py or main.py), or a shipped example's name",
    )
    p.add_argument(
        "args",
        nargs="*",
        metavar="TASK | ARG",
        help="a payload's task (default: the manifest's example_task; - reads it from "
        "stdin); a program's arguments and options, its sys.argv[1:]: every word after the "
        "program's path, orchestrator's option names too",
    )
    p.add_argument(
        "--task",
        dest="task_option",
        metavar="TEXT",
        help="a program: replaces the task of its first agent run (also in "
        "$ORCHESTRATOR_TASK); a payload: the same as the task argument",
    )
    add_run_options(p, "run")
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="additional_args entry for the agent",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no live output")
    p.set_defaults(
        handler=cmd_run, watches_stop=True, leaves_at_once=True, starts_up_in_handler=True
    )
    p.hand_on = HandOn(applies=names_a_program, dest="args", unknown_fix=unknown_option_fix)


def names_a_program(word: str) -> bool:
    """Whether `run WORD ...` runs a program (whose own arguments the words after it are)."""
    from ..payloads.manifest import payload_path
    from ..payloads.program import is_program

    return is_program(payload_path(word))


def unknown_option_fix(unknown: list[str], target: str | None, program: bool) -> str:
    """What to do with options `run` does not have (`unknown`), by what it was given to run:
    a program (`target`, the options were put before its path), a payload folder, else
    neither."""
    words = " ".join(unknown)
    if program:
        return (
            f"An option before the program's path is orchestrator's. To pass it to the "
            f"program, put it after the path: orchestrator run [OPTIONS] {target} {words} ... "
            "(orchestrator run --help lists orchestrator's own options)."
        )
    if target is not None and names_a_payload_folder(target):
        return (
            f"{target} is a payload folder, which takes no options of its own: give its task "
            f'as one quoted argument (orchestrator run {target} "your task") and values for '
            "its agent with --arg KEY=JSON. Only a program (a .py file, or a folder with "
            "main.py) takes its own options, after its path. orchestrator run --help lists "
            "orchestrator's options."
        )
    return (
        "orchestrator run --help lists its options. A program's own options go after the "
        f"program's path: orchestrator run [OPTIONS] PROGRAM {words}."
    )


def names_a_payload_folder(word: str) -> bool:
    from ..payloads.manifest import MANIFEST_NAME, payload_path

    return (payload_path(word) / MANIFEST_NAME).is_file()


def cmd_run(args: argparse.Namespace) -> int:
    from ..lifecycle.runner import observers_of, run_spec
    from .display import RunDisplay

    program = split_task(args)
    handed_on_notice(args)
    if args.task == "-":
        args.task = task_from_stdin()
    tidy_store()
    spec = spec_from_args(args, program_args=program)
    shadow_notice(args.payload)
    display = RunDisplay(quiet=args.quiet)
    signals.on_stop(display.progress)
    observers = observers_of(display.event, display.progress, signals.STOP)
    try:
        result = run_spec(spec, observers, on_prepared=prepared_notice)
    finally:
        display.stop()
    if result.status == "cancelled":
        say("cancelled: the sandbox was removed and the run recorded as `cancelled`")
    print_result(result, as_json=args.json)
    return result.cli_exit_code


def prepared_notice(prepared: PreparedRun) -> None:
    """The run is checked and its modules imported: the end of the process's start-up (the
    sandbox is asked for next), and what the user should know about it said."""
    from . import start_up_done

    start_up_done()
    mock_notice(prepared)


def mock_notice(prepared: PreparedRun) -> None:
    """Say so when the mock model will answer another task than the one given (it plays
    the payload's scripts, written for its example task)."""
    manifest = prepared.manifest
    if (
        prepared.model.provider == "mock"
        and manifest.program is None
        and prepared.task != manifest.example_task
    ):
        say(
            "the mock model plays the payload's [mock.scripts] whatever the task, so this "
            "run's answer is not about your task (the script answers the example task: "
            f"{manifest.example_task!r}); pass --model for a real model",
            kind="notice",
        )


def split_task(args: argparse.Namespace) -> tuple[str, ...]:
    """Set `args.task` from the positional arguments and --task; return a program's
    arguments. Raises OrchestratorError for a payload given more than one task."""
    from ..errors import OrchestratorError
    from ..payloads.manifest import payload_path
    from ..payloads.program import is_program

    if is_program(payload_path(args.payload)):
        args.task = args.task_option
        return tuple(args.args)
    if len(args.args) > 1 or (args.args and args.task_option is not None):
        raise OrchestratorError(
            f"{args.payload} is a payload, which takes one task, and was given "
            f"{len(args.args) + (args.task_option is not None)}: {args.args!r}.",
            'Quote the task as one argument: orchestrator run PAYLOAD "your whole task".',
        )
    args.task = args.args[0] if args.args else args.task_option
    return ()


def handed_on_notice(args: argparse.Namespace) -> None:
    """Say so when orchestrator's own option names were handed to the program (they came
    after its path), and how to give them to orchestrator instead; `PROGRAM -- ...` says
    they are the program's, and nothing is said."""
    own = getattr(args, OWN_OPTIONS_HANDED_ON, None)
    if own:
        say(
            f"{', '.join(own)} came after the program's path, so the program gets "
            f"{'it' if len(own) == 1 else 'them'} (its sys.argv), not orchestrator; for "
            f"orchestrator's, put {'it' if len(own) == 1 else 'them'} before the path "
            f"(orchestrator run {own[0]} ... {args.payload}); `{args.payload} -- ...` says "
            "they are the program's",
            kind="notice",
        )


def shadow_notice(payload: str) -> None:
    """Say so when a folder here takes the place of the shipped example of the same name
    (a `new research_team` scaffold, say), and how to run the example instead."""
    from ..payloads.manifest import shadowed_example

    example = shadowed_example(payload)
    if example is not None:
        say(
            f"{payload!r} is the folder ./{payload} here, not the shipped example of that name "
            f"({example}); to run the example, give its path: orchestrator run {example}",
            kind="notice",
        )


def task_from_stdin() -> str:
    """`run PAYLOAD -`: the task is all of stdin (a file: `< task.txt`), without the final
    newline. Raises OrchestratorError when stdin holds nothing."""
    from ..errors import OrchestratorError

    text = sys.stdin.read().rstrip("\n")
    if not text.strip():
        raise OrchestratorError(
            "The task is `-` (read from stdin), but stdin holds no text.",
            'Pipe the task in (echo "your task" | orchestrator run PAYLOAD -), or read it '
            "from a file (orchestrator run PAYLOAD - < task.txt).",
        )
    return text


def print_result(result: RunResult, *, as_json: bool) -> None:
    """The answer on stdout (or the whole result as JSON); how the run ended on stderr."""
    if as_json:
        print_json(result.to_dict())
        return
    duration = human_duration(result.timings.get("duration", 0))
    say(f"run {result.run_id}: {result.status} in {duration}")
    if result.error:
        print(f"  error: {result.error}", file=sys.stderr)
    print(f"  record: {result.record_dir}", file=sys.stderr)
    if result.status == "succeeded":
        answer = result.answer
        print(answer if isinstance(answer, str) else json.dumps(answer, default=str))
