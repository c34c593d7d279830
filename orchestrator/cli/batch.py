"""`orchestrator batch`: the command over `batch.run_batch`, with a live display and signals."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import textwrap
from typing import Any

from ..batch.budget import usd
from ..batch.export import FORMATS, export_batch
from ..batch.judge import JudgeOptions
from ..batch.output import OutputWriteError
from ..batch.plan import BatchSpec
from ..batch.prices import PRICE_EXAMPLE, parse_price
from ..batch.scoring import BUILTIN_SCORERS
from ..batch.session import BatchObservers, run_batch
from ..batch.sources import parse_fields, split_ids
from ..defaults import fill
from ..options import CONCURRENCY, options_for
from . import signals
from .batch_display import BatchDisplay
from .cluster import add_ray_option, leave_cluster, ray_batch
from .common import add_run_options, spec_from_args, tidy_store
from .output import say
from .parser import HELP

#: The run options a tasks row may set for its task (`options.RUN_OPTIONS`; `timeout` is
#: read as `timeout_seconds`), the limits, then any others, wrapped under their field name.
_OVERRIDES = "\n".join(
    textwrap.fill(
        ", ".join(o.name + "".join(f" (or {a})" for a in o.aliases) for o in chosen),
        width=90,
        initial_indent="  " + label.ljust(17),
        subsequent_indent=" " * 19,
    )
    for label, chosen in (
        ("per-task limits", [o for o in options_for("task") if o.limit]),
        ("per-task options", [o for o in options_for("task") if not o.limit]),
    )
    if chosen
)
EPILOG = f"""\
Tasks: a JSONL (one object a line), CSV (header row), JSON (an array) or Parquet file, a
Hugging Face dataset (hf://org/name:config@split, config and split as needed; from the
local cache when the hub cannot be reached) or a local dataset folder (save_to_disk, or
data files; FOLDER@split), with the fields (or columns mapped to them with --field, or in
TASKS.fields.toml beside the data; then other columns are kept under metadata):
  id               optional; else derived from task + additional_args (stable)
  task             the task text (required)
  additional_args  object handed to the agent (CSV: JSON, or one args.NAME column each)
  expected         expected answer (a list means any of them)
{_OVERRIDES}
  metadata         anything else, as an object (kept, shown to user scorers)

Resume: run the same command again with the same --output directory. Finished tasks are
kept; unfinished and infrastructure-failed ones run again (--rerun-failed: failed ones too).

Exit codes: 0 every task has an agent outcome (succeeded or not), 2 bad input (nothing
started), 5 tasks left with infrastructure errors, stopped by --fail-on-error,
--max-total-tokens or --max-cost (resume with a higher cap), or an output file could not
be written (disk full: free space, then resume with the same command), 130 interrupted
(resume with the same command).
"""


def add_batch_parser(sub: Any) -> None:
    p = sub.add_parser(
        "batch",
        help=HELP["batch"],
        description="Run a payload on every task of a tasks file, each in a fresh sandbox, in "
        "parallel; append results to OUTPUT/results.jsonl as tasks end and write "
        "OUTPUT/summary.json.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "payload", help="payload folder (holding manifest.toml), or a shipped example's name"
    )
    p.add_argument(
        "tasks",
        help="tasks: a .jsonl, .csv, .json or .parquet file, a Hugging Face dataset "
        "(hf://org/name:config@split, config and split as needed), or a dataset folder",
    )
    p.add_argument(
        "--output",
        "-o",
        help="batch directory, created; the same one resumes (default: "
        "./batches/PAYLOAD-TASKS, from the payload folder's name and the tasks file's stem)",
    )
    add_run_options(p, "batch")
    _add_dataset_options(p)
    _add_pace_options(p)
    _add_scoring_options(p)
    _add_retry_options(p)
    _add_spend_options(p)
    _add_epoch_options(p)
    p.add_argument(
        "--on-bad-line",
        choices=["fail", "skip"],
        default="fail",
        help="a malformed tasks line: refuse the file (default) or skip the line with a warning",
    )
    add_ray_option(p, "the attempts")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no live progress")
    p.set_defaults(handler=cmd_batch, watches_stop=True)


def _add_dataset_options(p: argparse.ArgumentParser) -> None:
    """Which columns are the task's fields, and which tasks run (`batch/sources.py`)."""
    p.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="FIELD=COLUMN",
        help="read FIELD (task, expected, id, additional_args, metadata, a limit, or "
        "args.NAME) from the dataset's COLUMN, e.g. --field task=question; repeatable; wins "
        "over TASKS.fields.toml; other columns are then kept under metadata",
    )
    p.add_argument("--limit", type=int, metavar="N", help="run only the first N tasks")
    p.add_argument(
        "--sample-id",
        action="append",
        default=[],
        metavar="ID",
        help="run only the task(s) with this id; repeatable, or a comma list",
    )
    p.add_argument(
        "--shuffle",
        type=int,
        metavar="SEED",
        help="run the tasks in an order drawn from SEED (the same seed, the same order, "
        "whatever the file's); with --limit N, a random sample of N",
    )


def _add_pace_options(p: argparse.ArgumentParser) -> None:
    """How many at once: the ceiling, fixed or adaptive, and the warm sandboxes."""
    p.add_argument(
        CONCURRENCY.flag,
        "-j",
        dest=CONCURRENCY.name,
        type=concurrency_arg,
        metavar=CONCURRENCY.metavar,
        help=CONCURRENCY.help_text(),
    )
    p.add_argument(
        "--fixed-concurrency",
        action="store_true",
        help="run exactly --concurrency N at once, never adapting (for measurements; with "
        "--ray, each node runs all it declares)",
    )
    warm = p.add_mutually_exclusive_group()
    warm.add_argument(
        "--warm",
        type=int,
        metavar="N",
        help="keep N sandboxes (0 to 32) started ahead of the runs that take them, each used "
        "once (default: as many as the concurrency when there are more tasks than that)",
    )
    warm.add_argument(
        "--no-warm",
        dest="warm",
        action="store_const",
        const=0,
        help="start every run's sandbox when the run starts",
    )


def _add_scoring_options(p: argparse.ArgumentParser) -> None:
    """How an answer is scored."""
    p.add_argument(
        "--scorer",
        action="append",
        help=f"{', '.join(BUILTIN_SCORERS)}, model (a judge grades it: --judge), or "
        "module:function / file.py:function (default: exact, after normalising case, spaces, "
        "quotes and a final full stop); repeatable: the first is the batch's accuracy, every "
        "one is recorded",
    )
    add_judge_options(p)
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-6,
        help="numeric scorer: |answer - expected| <= T * max(1, |expected|) (default 1e-6)",
    )


# -- the judge of --scorer model (`batch/judge.py`) ------------------------------------------


def add_judge_options(p: argparse.ArgumentParser) -> None:
    """The judge's model, endpoint and template (`batch` and `batch rescore`)."""
    p.add_argument(
        "--judge",
        metavar="PROVIDER:ID",
        help="the model that grades answers for --scorer model (as --model; an OpenAI-"
        "compatible one), called on this host through a model gateway of the batch's own: its "
        "key (read as a run's secrets) never enters a sandbox; its tokens count in the spend",
    )
    p.add_argument("--judge-api-base", metavar="URL", help="the judge's endpoint (as --api-base)")
    p.add_argument(
        "--judge-key-env",
        metavar="NAME",
        help="the variable holding the judge's key (default: its provider's, e.g. OPENAI_API_KEY)",
    )
    p.add_argument(
        "--judge-template",
        metavar="FILE",
        help="the grading prompt, with {question}, {expected} and {answer}; the judge ends "
        "its reply with GRADE: C (correct), P (partly) or I (default: Inspect AI's "
        "model_graded_fact)",
    )


def judge_from_args(args: argparse.Namespace) -> JudgeOptions | None:
    if not args.judge:
        return None
    return JudgeOptions(
        args.judge, args.judge_api_base, args.judge_template, args.env_file, args.judge_key_env
    )


# ---------------------------------------------------------------------------------------------


def _add_retry_options(p: argparse.ArgumentParser) -> None:
    """Retries on infrastructure faults, reruns on resume, and when to give up."""
    p.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="attempts per task on infrastructure faults only (default 3; 1 = no retry)",
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=2.0,
        dest="backoff_seconds",
        help="first retry wait in seconds, doubling each time, plus jitter (default 2)",
    )
    p.add_argument(
        "--rerun-failed",
        action="store_true",
        help="on resume, also run again tasks that failed, timed out or ran out of memory",
    )
    p.add_argument(
        "--fail-on-error",
        type=float,
        metavar="RATIO",
        help="stop (exit 5) once more than this share of tasks (< 1), or this many tasks "
        "(>= 1), ended in infra_error after their retries",
    )


def _add_spend_options(p: argparse.ArgumentParser) -> None:
    """The batch's spend caps: tokens, cost, and the prices cost is counted at."""
    p.add_argument(
        "--max-total-tokens",
        type=int,
        metavar="N",
        help="the batch's token cap: once its tasks spent N tokens (input + output, every "
        "attempt of every session, as the model gateway measured them, else as the sandboxes "
        "reported), no task starts and running ones are stopped (exit 5); re-run with a higher "
        "N to resume (default: no cap)",
    )
    p.add_argument(
        "--max-cost",
        metavar="USD",
        help="the batch's cost cap in US dollars: as --max-total-tokens, counting each model "
        "call's gateway-measured tokens at the price of the model it names (--price, else the "
        "prices bundled with genai-prices, offline); a model with no known price, or runs "
        "without the model gateway, are refused before anything starts, and a call whose cost "
        "cannot be counted stops the batch; mock costs 0 (default: no cap)",
    )
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="MODEL=IN/OUT",
        help="the price --max-cost counts MODEL (as --model spells it) at: US dollars per "
        f"million input and output tokens, e.g. {PRICE_EXAMPLE}; repeatable; wins over the "
        "bundled prices",
    )


def _add_epoch_options(p: argparse.ArgumentParser) -> None:
    """How many times each task runs (epochs), for figures that say how sure they are."""
    p.add_argument(
        "--epochs",
        type=int,
        default=1,
        metavar="N",
        help="run each task N times, each attempt in its own sandbox with its own result line "
        "(resumable and retried per epoch); the summary adds each task's epochs reduced by "
        "mean, max and mode, and pass@k for every k up to N (default 1)",
    )


def batch_spec_from_args(args: argparse.Namespace) -> BatchSpec:
    scorers = args.scorer or ["exact"]
    return BatchSpec(
        tasks=args.tasks,
        output=args.output,
        run=spec_from_args(args, task=None, additional_args=None),
        concurrency=None
        if args.concurrency == "auto"
        else fill({"concurrency": args.concurrency})["concurrency"],
        adapt=not args.fixed_concurrency,
        scorer=scorers[0] if len(scorers) == 1 else tuple(scorers),
        judge=judge_from_args(args),
        tolerance=args.tolerance,
        max_attempts=args.max_attempts,
        backoff_seconds=args.backoff_seconds,
        rerun_failed=args.rerun_failed,
        fail_on_error=args.fail_on_error,
        on_bad_line=args.on_bad_line,
        warm=args.warm,
        max_total_tokens=args.max_total_tokens,
        max_cost=args.max_cost,
        prices=dict(parse_price(text) for text in args.price),
        field_map=parse_fields(args.field),
        sample_ids=tuple(split_ids(args.sample_id)),
        shuffle=args.shuffle,
        limit=args.limit,
        epochs=args.epochs,
    )


def concurrency_arg(value: str) -> int | str:
    """`auto` or a whole number of sandboxes (checked by the batch: at least 1)."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither auto nor a whole number of sandboxes"
        ) from None


def cmd_batch(args: argparse.Namespace) -> int:
    tidy_store()
    spec = batch_spec_from_args(args)
    display = BatchDisplay(quiet=args.quiet)
    signals.on_stop(display.message)
    command = shlex.join(["orchestrator", *sys.argv[1:]])
    executor = None
    try:
        executor, spec = ray_batch(args, spec, display.message)
        summary = run_batch(
            spec,
            executor=executor,
            observers=BatchObservers(
                cancel=signals.STOP, monitor=display.update, on_message=display.message
            ),
        )
    except OutputWriteError as exc:  # before any task started (batch.json, the lock)
        say(f"{exc.cause}. {write_advice(command)}", kind="error")
        return exc.exit_code
    finally:
        display.stop()
        leave_cluster(executor)
    display.final(summary)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2, default=str))
    reason = summary.stop_reason or ""
    if reason.startswith("write_error:"):  # one line: what failed, what to do
        cause = reason.split(":", 1)[1].strip()
        say(f"{cause}. {write_advice(command)}", kind="stopped")
    elif reason == "budget_exceeded":
        what, then = spend_stop(summary.spend)
        say(f"stopped: {what}; finished tasks are in {summary.output_dir}/results.jsonl")
        print(f"  resume with the same command {then}: {command}", file=sys.stderr)
    elif summary.state != "complete" or summary.counts.get("infra_error"):
        what = {
            "interrupted": "interrupted: every sandbox was removed; finished tasks are in",
            "stopped": "stopped by --fail-on-error; finished tasks are in",
        }.get(summary.state, "tasks ended in infra_error; results are in")
        say(f"{what} {summary.output_dir}/results.jsonl")
        print(f"  resume with: {command}", file=sys.stderr)
    return summary.exit_code


def spend_stop(spend: dict[str, Any]) -> tuple[str, str]:
    """What stopped the batch (which cap, how much was spent), and what a resume needs."""
    if spend.get("stopped_by") == "max_cost":
        return (
            f"the batch's cap --max-cost {usd(spend['max_cost_usd'])} was reached "
            f"({usd(spend['cost_usd'])} spent, {spend['tokens']} tokens)",
            "and a higher --max-cost",
        )
    if spend.get("stopped_by") == "uncounted":
        return (
            f"the cost of {spend['uncounted_calls']} model call(s) could not be counted (no "
            "usage measured, or a model with no known price), so --max-cost cannot keep the "
            "cap (fail closed; the reason is in the stopped runs' attempts.jsonl lines)",
            "once the model server reports usage and every model called has a --price (or "
            "with --max-total-tokens instead)",
        )
    return (
        f"the batch's cap --max-total-tokens {spend['max_total_tokens']} was reached "
        f"({spend['tokens']} tokens spent)",
        "and a higher --max-total-tokens",
    )


def write_advice(command: str) -> str:
    return (
        "Finished tasks are kept; free space (or fix permissions), then re-run the same "
        f"command to resume: {command}"
    )


def add_export_verb(sub: Any) -> None:
    """`batch export DIR --format inspect|parquet`: the batch for other tools, running nothing."""
    batch = sub.choices["batch"]
    batch.description += " `batch export DIR --format inspect|parquet` (for other tools)."
    export = batch.add_verb(
        "export",
        description="Write a batch for other tools, running nothing: --format inspect, an "
        "Inspect AI eval log (`inspect view --log-dir DIR/inspect` opens it; default "
        "DIR/inspect/<created>_<payload>_<batch>.eval, .json with -o x.json), or --format "
        "parquet, one row per attempt (default DIR/results.parquet). Needs the export extra: "
        "pip install 'orchestrator[export]'.",
    )
    export.add_argument("dir", help="the batch's output folder (batch ... --output DIR)")
    export.add_argument("--format", required=True, choices=FORMATS, help="inspect or parquet")
    export.add_argument("--output", "-o", metavar="FILE", help="where to write it")
    export.set_defaults(handler=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    print(f"written: {export_batch(args.dir, args.format, args.output)}")
    return 0
