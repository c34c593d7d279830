"""`orchestrator batch report DIR`, `orchestrator batch rescore DIR --scorer S` and
`orchestrator batch compare A B`: a batch's figures and the tasks to look at, or two batches
paired, read from their folders; nothing runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..batch.compare import Comparison, compare
from ..batch.epochs import describe as describe_epochs
from ..batch.report import BatchReport, build_report
from ..batch.rescore import rescore, rescore_path
from ..batch.scoring import BUILTIN_SCORERS
from ..errors import OrchestratorError
from .batch import add_judge_options, judge_from_args

#: How much of an answer, expected answer or error a terminal line shows (--json and --csv
#: have them whole).
CELL = 120


def add_batch_verbs(sub: Any) -> None:
    """Hang `report` and `rescore` on the `batch` command (see `parser.CommandParser`)."""
    batch = sub.choices["batch"]
    batch.description += (
        " Also: `batch report DIR` (the figures, and the wrong and failed tasks) and "
        "`batch rescore DIR --scorer S` (score the recorded answers again) and `batch compare "
        "A B` (two batches over the same tasks: the paired difference and whether it is real)."
    )
    report = batch.add_verb(
        "report",
        description="A batch's accuracy (95% Wilson interval), counts by status, and its wrong "
        "and failed tasks first with answer vs expected and the error. Runs nothing.",
    )
    report.add_argument("dir", help="the batch's output folder (batch ... --output DIR)")
    report.add_argument("--json", action="store_true", help="the whole report as JSON")
    report.add_argument("--csv", metavar="FILE", help="also write every task as a CSV row")
    report.add_argument("--all", action="store_true", help="list every task, right ones too")
    report.set_defaults(handler=cmd_report)
    again = batch.add_verb(
        "rescore",
        description="Score a batch's recorded answers again with another scorer, running "
        "nothing. Writes DIR/summary.rescore-<scorer>.json beside summary.json; results.jsonl "
        "is left as it is.",
    )
    again.add_argument("dir", help="the batch's output folder")
    again.add_argument(
        "--scorer",
        required=True,
        help=f"{', '.join(BUILTIN_SCORERS)}, model (--judge; grades already asked for are "
        "read from DIR/judge.jsonl, not paid again), or module:function / file.py:function",
    )
    again.add_argument("--tolerance", type=float, default=1e-6, help="numeric scorer tolerance")
    add_judge_options(again)
    again.add_argument("--env-file", help="dotenv file the judge's key is read from (./.env)")
    again.add_argument("--json", action="store_true", help="the new report as JSON")
    again.add_argument("--csv", metavar="FILE", help="also write every task as a CSV row")
    again.set_defaults(handler=cmd_rescore)
    pair = batch.add_verb(
        "compare",
        description="Two batches over the same tasks, paired by task id: the difference in "
        "accuracy (B - A) with its 95% interval, a paired test (McNemar's exact test for "
        "pass/fail, the paired t test for scores or epochs), and whether the difference is "
        "distinguishable (p < 0.05) or not; then the tasks that flipped. Runs nothing.",
    )
    pair.add_argument("a", help="the first batch's output folder (A)")
    pair.add_argument("b", help="the second batch's output folder (B)")
    pair.add_argument("--json", action="store_true", help="the whole comparison as JSON")
    pair.set_defaults(handler=cmd_compare)


def cmd_report(args: argparse.Namespace) -> int:
    report = build_report(args.dir)
    return show(report, args, every=args.all)


def cmd_rescore(args: argparse.Namespace) -> int:
    report = rescore(args.dir, args.scorer, tolerance=args.tolerance, judge=judge_from_args(args))
    code = show(report, args, every=False)
    if not args.json:
        print(f"written: {rescore_path(args.dir, args.scorer)}")
    return code


def cmd_compare(args: argparse.Namespace) -> int:
    result = compare(build_report(args.a), build_report(args.b))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print_comparison(result)
    return 0


def print_comparison(c: Comparison) -> None:
    """The verdict first, then the figures behind it and the tasks that flipped."""
    print(f"A {c.a} vs B {c.b}: {c.paired} paired task(s)")
    if c.difference is None or c.accuracy_a is None or c.accuracy_b is None:
        print("  no task scored in both: nothing to compare")
        return
    interval = f", 95% CI {c.ci95[0]:+.1%} to {c.ci95[1]:+.1%}" if c.ci95 else ""
    test = {"mcnemar_exact": "McNemar's exact test", "paired_t": "paired t test"}[c.test]
    print(f"  accuracy {c.accuracy_a:.1%} → {c.accuracy_b:.1%}: {c.difference:+.1%}{interval}")
    print(f"  {c.verdict} ({test}, p = {c.p_value:.3g})")
    if c.only_in_a or c.only_in_b:
        print(f"  not paired: {len(c.only_in_a)} only in A, {len(c.only_in_b)} only in B")
    for title, flips in (("became wrong in B", c.to_wrong), ("became right in B", c.to_right)):
        if flips:
            print(f"\n{len(flips)} task(s) {title}:")
            for flip in flips:
                print(f"  {flip['id']}  A {clip(flip['answer_a'])}  B {clip(flip['answer_b'])}")
    sys.stdout.flush()


def show(report: BatchReport, args: argparse.Namespace, *, every: bool) -> int:
    if args.csv:
        try:
            Path(args.csv).write_text(report.to_csv(), encoding="utf-8")
        except OSError as exc:
            error = OrchestratorError(
                f"Cannot write {args.csv}: {exc.strerror or exc}.",
                "Choose a path in a folder you can write to.",
            )
            error.exit_code = 5
            raise error from exc
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print_report(report, every=every)
    return 0


def clip(value: Any) -> str:
    text = "" if value is None else value if isinstance(value, str) else json.dumps(value)
    text = " ".join(text.split())
    return text if len(text) <= CELL else text[: CELL - 1] + "…"


def figures(report: BatchReport) -> list[tuple[str, str]]:
    """The report's header as (label, value) lines."""
    lines = [("batch", f"{report.batch_id} ({report.path})")]
    if report.payload:
        lines.append(("payload", f"{report.payload} · model {report.model}"))
    scorer = report.scorer
    if report.rescored_from:
        scorer += f" (rescored; the batch ran with {report.rescored_from})"
    lines.append(
        ("accuracy", report.accuracy_text(scorer) or f"n/a (no task scored; scorer {scorer})")
    )
    if report.epochs > 1:  # each task's epochs reduced, with standard errors across tasks
        if report.accuracy_stderr is not None:
            lines.append(("std error", f"{report.accuracy_stderr:.1%} (clustered by task)"))
        lines.append(("epochs", f"{report.epochs} per task"))
        lines.extend(describe_epochs(report.epoch_metrics))
    counts = " · ".join(f"{k} {v}" for k, v in report.counts.items() if v or k == "succeeded")
    lines.append(("status", f"{counts} · total {report.total}"))
    if report.duration_p50 is not None:
        p50, p95 = report.duration_p50, report.duration_p95 or 0.0
        lines.append(("duration", f"p50 {p50:.1f}s · p95 {p95:.1f}s"))
    lines.append(("tokens", f"{report.tokens['input']} in · {report.tokens['output']} out"))
    return lines


def print_report(report: BatchReport, *, every: bool) -> None:
    for label, value in figures(report):
        print(f"{label:>9}  {value}")
    rows = report.rows if every else report.to_review
    if not rows:
        print("\nno wrong or failed task")
        return
    title = "every task" if every else f"{len(rows)} task(s) to look at"
    print(f"\n{title} (wrong and failed first):")
    for row in rows:
        epoch = f" (epoch {row['epoch']})" if "epoch" in row else ""
        head = f"{row['verdict'].upper():<8} {row['id']}{epoch}  [{row['status']}]"
        print(f"\n  {head}  run {row['run_id']}")
        print(f"    answer:   {clip(row['answer'])}")
        print(f"    expected: {clip(row['expected'])}")
        if row["error"]:
            print(f"    error:    {clip(row['error'])}")
        if row.get("grade") and row["grade"].get("text"):
            print(f"    judge:    {clip(row['grade']['text'])}")
    sys.stdout.flush()
