"""What gVisor costs: runc vs gVisor (runsc) side by side in one run (issue 26).

The same image and the same trivial agent (batch_math mul: one scripted step) on each
runtime, interleaved so that a drift in load favours neither:

- `cold run`: the `orchestrator run` command (hardened sandbox, run record), as a process;
- `warm run`: `Pool.run` with a ready sandbox (the Python API), end to end;
- `batch`: N tasks at concurrency 2 through `run_batch` (warm sandboxes, as by default).

Needs gVisor registered (`sudo bash scripts/setup-gvisor.sh`). Run by hand (not a test;
about 5 minutes on 2 cores):

    python benchmarks/sandbox_kernel.py [--rounds 5] [--tasks 60]

Writes benchmarks/results/sandbox_kernel.json and .md; the load average before each part is
recorded, so a busy machine shows in the figures.
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
from batch_throughput import SameImageBackend, tasks  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.batch import BatchSpec, run_batch  # noqa: E402
from orchestrator.execution.pool import Pool  # noqa: E402
from orchestrator.lifecycle.runner import prepare  # noqa: E402
from orchestrator.spec import RunSpec  # noqa: E402

PAYLOAD = REPO / "tests" / "payloads" / "batch_math"
RESULTS = REPO / "benchmarks" / "results"
ARGS = {"op": "mul", "a": 6, "b": 7}
RUNTIMES = ("runc", "runsc")
SETTLE_SECONDS = 10


def cold_cli(runtime: str) -> float:
    started = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "run",
            str(PAYLOAD),
            "mul",
            "--arg",
            'op="mul"',
            "--arg",
            "a=6",
            "--arg",
            "b=7",
            "--sandbox-runtime",
            runtime,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    took = time.perf_counter() - started
    result = json.loads(out.stdout) if out.returncode == 0 else {}
    if result.get("answer") != 42 or result.get("sandbox", {}).get("runtime") != runtime:
        raise SystemExit(f"cold run on {runtime}: {out.stdout[-500:]}{out.stderr[-500:]}")
    return took


def warm_runs(backend, runtime: str, rounds: int) -> list[float]:
    spec = RunSpec(payload=PAYLOAD, task="mul", additional_args=ARGS, sandbox_runtime=runtime)
    ends = []
    with Pool(size=1, ttl=120, backend=backend) as pool:
        pool.keep_ready(prepare(spec))
        for _ in range(rounds):
            while pool.stats()["idle"] < pool.size:
                time.sleep(0.05)
            started = time.perf_counter()
            result = pool.run(spec)
            ends.append(time.perf_counter() - started)
            if result.status != "succeeded" or not result.warm:
                raise SystemExit(f"warm run on {runtime}: {result.status} {result.error}")
            if result.sandbox.get("runtime") != runtime:
                raise SystemExit(f"warm run asked for {runtime} ran on {result.sandbox}")
    return ends


def batch(backend, runtime: str, n: int, workdir: Path) -> float:
    path = workdir / f"tasks-{runtime}.jsonl"
    with open(path, "w") as file:
        for i, (a, b) in enumerate(tasks(n)):
            row = {
                "id": f"t{i}",
                "task": "mul",
                "expected": a * b,
                "additional_args": {"op": "mul", "a": a, "b": b},
            }
            file.write(json.dumps(row) + "\n")
    spec = BatchSpec(
        tasks=path,
        output=workdir / f"out-{runtime}",
        run=RunSpec(payload=PAYLOAD, sandbox_runtime=runtime),
        concurrency=2,
    )
    started = time.monotonic()
    summary = run_batch(spec, backend=backend)
    if summary.correct != n:
        raise SystemExit(f"batch on {runtime}: {summary.counts}")
    return n / (time.monotonic() - started) * 60


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=60)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="kernel-bench-"))
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")
    os.environ.pop("ORCHESTRATOR_SANDBOX_RUNTIME", None)
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    backend = SameImageBackend(client, image)
    for runtime in RUNTIMES:
        cold_cli(runtime)  # the page cache and the image layers, for each side

    figures: dict[str, dict[str, list[float]]] = {r: {"cold": [], "warm": []} for r in RUNTIMES}
    loads = {"cold": context.load()}
    for i in range(args.rounds):
        for runtime in RUNTIMES:
            figures[runtime]["cold"].append(cold_cli(runtime))
        print(
            f"round {i + 1}: " + ", ".join(f"{r} {figures[r]['cold'][-1]:.2f}s" for r in RUNTIMES)
        )
    loads["warm"] = context.load()
    for runtime in RUNTIMES:
        figures[runtime]["warm"] = warm_runs(backend, runtime, args.rounds)
        print(f"warm on {runtime}: {median(figures[runtime]['warm'])}s")
    per_minute = {}
    for runtime in RUNTIMES:
        time.sleep(SETTLE_SECONDS)
        loads[f"batch {runtime}"] = context.load()
        per_minute[runtime] = round(batch(backend, runtime, args.tasks, workdir), 1)
        print(f"batch on {runtime}: {per_minute[runtime]} tasks/min")

    rows = {r: {k: median(v) for k, v in figures[r].items()} for r in RUNTIMES}
    report = {
        "what": "trivial CodeAgent (batch_math mul: one scripted step), same image everywhere",
        "image": image,
        **context.header(client),
        "rounds": args.rounds,
        "tasks": args.tasks,
        "loads": loads,
        "medians_seconds": rows,
        "batch_per_minute": per_minute,
        "raw": figures,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sandbox_kernel.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# runc vs gVisor (runsc)",
        "",
        f"{report['what']}; {context.summary(report)}; {args.rounds} rounds, medians; batch of "
        f"{args.tasks} at concurrency 2; load average {loads}.",
        "",
        "| path | runc | gVisor | gVisor / runc |",
        "|---|---|---|---|",
    ]
    for key, label in (("cold", "cold run (s)"), ("warm", "warm run (s)")):
        a, b = rows["runc"][key], rows["runsc"][key]
        lines.append(f"| {label} | {a} | {b} | {round(b / a, 2)} |")
    a, b = per_minute["runc"], per_minute["runsc"]
    lines.append(f"| batch (tasks/min) | {a} | {b} | {round(b / a, 2)} |")
    (RESULTS / "sandbox_kernel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
