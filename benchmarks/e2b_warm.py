"""Warm E2B sandboxes against cold ones, side by side in one run (issue 22, acceptance 4).

`orchestrator batch --backend e2b --concurrency 1` over the same N tasks (batch_math mul: one
scripted CodeAgent step), warm (the default: a pool of pooled sandboxes, each serving one
run) and `--no-warm` (every task's sandbox created and its runtime started when the task
comes), in alternating rounds so that a drift in the machine's load favours neither side.
Each batch is the real command in its own process against the local E2B test server
(`tests/e2b_server`: E2B's wire protocol, sandboxes as Docker containers), through the real
`e2b` SDK; the figures are that server's, not E2B's cloud (whose API calls cross a network).

Run by hand (not a test; about 15 minutes on 2 cores with the defaults):

    python benchmarks/e2b_warm.py [--rounds 3] [--tasks 30]

Writes benchmarks/results/e2b_warm.json and .md, with the load average before each batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402

from orchestrator.backends.e2b import E2BSettings, ensure_template  # noqa: E402
from tests.e2b_server import E2BTestServer  # noqa: E402
from tests.e2b_server.fixtures import TEST_TEMPLATE, base_image  # noqa: E402

PAYLOAD = REPO / "tests" / "payloads" / "batch_math"
RESULTS = REPO / "benchmarks" / "results"
#: The acceptance bar: warm tasks per minute over cold ones at concurrency 1.
GOAL = 1.5


def write_tasks(path: Path, n: int) -> Path:
    with open(path, "w") as file:
        for i in range(n):
            a, b = i + 2, i % 7 + 3
            row = {
                "id": f"t{i}",
                "task": "mul",
                "expected": a * b,
                "additional_args": {"op": "mul", "a": a, "b": b},
            }
            file.write(json.dumps(row) + "\n")
    return path


def batch(tasks: Path, n: int, out: Path, warm: bool) -> dict[str, float]:
    """One `orchestrator batch --backend e2b --concurrency 1` (warm or --no-warm): tasks per
    minute as the batch reports them (its session: from its first task handed out to its
    last result), over the command's whole life (start-up, template lookup and the payload's
    load check included), and the runs' median time from record to result."""
    command = [
        sys.executable,
        "-m",
        "orchestrator",
        "batch",
        str(PAYLOAD),
        str(tasks),
        "-o",
        str(out),
        "--backend",
        "e2b",
        "--concurrency",
        "1",
        "--quiet",
    ]
    if not warm:
        command.append("--no-warm")
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    took = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"batch failed ({done.returncode}): {done.stderr[-2000:]}")
    results = [json.loads(line) for line in (out / "results.jsonl").open()]
    summary = json.loads((out / "summary.json").read_text())
    correct = summary["correct"]
    if correct != n:
        raise SystemExit(f"batch: {correct} of {n} correct")
    warm_runs = 0
    per_run = []
    for row in results:
        saved = json.loads((Path(row["record_dir"]) / "result.json").read_text())
        warm_runs += bool(saved.get("warm"))
        per_run.append(saved["timings"]["ended"] - saved["timings"]["created"])
    durations = statistics.median(per_run)
    return {
        "per_minute": round(summary["session"]["tasks_per_minute"], 1),
        "command_per_minute": round(n / took * 60, 1),
        "seconds": round(took, 2),
        "warm_runs": warm_runs,
        "run_median_seconds": round(durations, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=30)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="e2b-warm-bench-"))
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    base = base_image()
    os.environ["ORCHESTRATOR_E2B_BASE_IMAGE"] = base
    tasks = write_tasks(workdir / "tasks.jsonl", args.tasks)
    sides: dict[str, list[dict[str, float]]] = {"warm": [], "cold": []}
    with E2BTestServer(templates={"base": base, TEST_TEMPLATE: base}) as server:
        os.environ.update(server.env())
        template = ensure_template(E2BSettings.from_env(), progress=lambda m: print(m))
        batch(write_tasks(workdir / "one.jsonl", 1), 1, workdir / "first", warm=False)
        for i in range(args.rounds):
            order = ["warm", "cold"] if i % 2 == 0 else ["cold", "warm"]
            for side in order:
                before = context.load()
                figures = batch(tasks, args.tasks, workdir / f"{side}-{i}", side == "warm")
                figures["load_before"] = before
                sides[side].append(figures)
                print(f"round {i + 1} {side}: {figures}", flush=True)
                if server.alive_count():
                    raise SystemExit(f"sandboxes left alive after a batch: {server.alive_ids()}")
        created = len(server.create_requests)

    def med(side: str, key: str) -> float:
        return round(statistics.median(f[key] for f in sides[side]), 3)

    ratio = round(med("warm", "per_minute") / med("cold", "per_minute"), 2)
    report = {
        "what": f"orchestrator batch --backend e2b --concurrency 1, {args.tasks} batch_math mul "
        "tasks (one scripted CodeAgent step), warm vs --no-warm, against tests/e2b_server",
        "template": template,
        **context.header(),
        "rounds": args.rounds,
        "tasks": args.tasks,
        "rounds_figures": sides,
        "warm_per_minute_median": med("warm", "per_minute"),
        "cold_per_minute_median": med("cold", "per_minute"),
        "warm_command_per_minute_median": med("warm", "command_per_minute"),
        "cold_command_per_minute_median": med("cold", "command_per_minute"),
        "command_ratio": round(
            med("warm", "command_per_minute") / med("cold", "command_per_minute"), 2
        ),
        "warm_run_median_seconds": med("warm", "run_median_seconds"),
        "cold_run_median_seconds": med("cold", "run_median_seconds"),
        "ratio": ratio,
        "sandboxes_created": created,
        "goal": f"warm >= {GOAL}x the tasks per minute of --no-warm",
        "met": ratio >= GOAL,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "e2b_warm.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = [
        f"| {i + 1} {side} | {f['per_minute']} | {f['command_per_minute']} | {f['seconds']} "
        f"| {f['warm_runs']} "
        f"| {f['run_median_seconds']} | {f['load_before']} |"
        for i in range(args.rounds)
        for side in (["warm", "cold"] if i % 2 == 0 else ["cold", "warm"])
        for f in [sides[side][i]]
    ]
    lines = [
        "# Warm E2B sandboxes: batch at concurrency 1, warm vs --no-warm",
        "",
        f"{report['what']}; {context.summary(report)}; {args.rounds} alternating rounds, medians.",
        "",
        "| side | tasks/min, batch's own (median) | tasks/min, whole command (median) "
        "| run, created -> ended (median s) |",
        "|---|---|---|---|",
        f"| warm | {report['warm_per_minute_median']} | "
        f"{report['warm_command_per_minute_median']} | {report['warm_run_median_seconds']} |",
        f"| --no-warm | {report['cold_per_minute_median']} | "
        f"{report['cold_command_per_minute_median']} | {report['cold_run_median_seconds']} |",
        "",
        f"Warm / --no-warm: **{ratio}x** the batch's own tasks per minute "
        f"({'met' if report['met'] else 'NOT met'}: {report['goal']}); "
        f"{report['command_ratio']}x over the whole command (start-up, template lookup and "
        "the payload's load check, the same on both sides, included).",
        "",
        "| round, side | tasks/min (batch) | tasks/min (command) | command (s) | warm runs "
        "| run median (s) | load (1 min) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    (RESULTS / "e2b_warm.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
