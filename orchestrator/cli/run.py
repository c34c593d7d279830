"""`orchestrator run`: one payload, one fresh sandbox, live events."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..spec import RunResult
from . import signals
from .common import (
    EPILOG_EXIT,
    add_run_options,
    spec_from_args,
    tidy_store,
)
from .output import human_duration, print_json, say
from .parser import HELP


def add_run_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help=HELP["run"],
        description="Run a payload (a folder with manifest.toml) on a task in one fresh, "
        "hardened sandbox, stream its events, and keep a run record.",
        epilog="Example: orchestrator run agent_payloads/research_team --model mock\n"
        + EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "payload", help="payload folder (holding manifest.toml), or a shipped example's name"
    )
    p.add_argument(
        "task", nargs="?",
        help="the task (default: the manifest's example_task); - reads it from stdin",
    )  # fmt: skip
    add_run_options(p)
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="additional_args entry for the agent",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no live output")
    p.set_defaults(handler=cmd_run, watches_stop=True)


def cmd_run(args: argparse.Namespace) -> int:
    from ..backends import get_backend
    from ..runner import execute, observers_of, prepare
    from .display import RunDisplay

    if args.task == "-":
        args.task = task_from_stdin()
    tidy_store()
    spec = spec_from_args(args)
    shadow_notice(args.payload)
    prepared = prepare(spec)
    if prepared.model.provider == "mock" and prepared.task != prepared.manifest.example_task:
        say(
            "the mock model plays the payload's [mock.scripts] whatever the task, so this "
            "run's answer is not about your task (the script answers the example task: "
            f"{prepared.manifest.example_task!r}); pass --model for a real model",
            kind="notice",
        )
    backend = get_backend(prepared.backend, env_file=spec.env_file)
    display = RunDisplay(quiet=args.quiet)
    signals.on_stop(display.progress)
    observers = observers_of(display.event, display.progress, signals.STOP)
    try:
        result = execute(prepared, backend=backend, observers=observers)
    finally:
        display.stop()
    if result.status == "cancelled":
        say("cancelled: the sandbox was removed and the run recorded as `cancelled`")
    print_result(result, as_json=args.json)
    return result.cli_exit_code


def shadow_notice(payload: str) -> None:
    """Say so when a folder here takes the place of the shipped example of the same name
    (a `new research_team` scaffold, say), and how to run the example instead."""
    from ..manifest import shadowed_example

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
        error = result.error
        print(f"  error: {error.get('type')}: {error.get('message')}", file=sys.stderr)
    print(f"  record: {result.record_dir}", file=sys.stderr)
    if result.status == "succeeded":
        answer = result.answer
        print(answer if isinstance(answer, str) else json.dumps(answer, default=str))
