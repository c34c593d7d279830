"""What evaluation-grade batches cost: 100 attempts of the mock batch_math task as one epoch
of 100 tasks, as 20 tasks x 5 epochs (`--epochs 5`), and as 100 tasks scored by `exact` and
a model judge (`--scorer exact --scorer model`, a scripted OpenAI-compatible judge on this
host), beside the floor: the same agent as 100 bare `docker run --rm` at the same
concurrency. Measured side by side in one run, the order of the four turning each round.

For each: wall time, attempts per minute, the host's CPU seconds per attempt (this process,
which runs the batch in-process, and its children: the orchestrator's share, sandboxes
excluded) and, with the judge, each judge call's latency as the batch saw it (prompt built,
in-process gateway, HTTP to the judge, grade parsed, cached).

Run by hand on an otherwise idle machine (not a test; about 6 minutes on 2 cores):

    python benchmarks/batch_eval.py [--concurrency 4] [--repeat 2]

Writes benchmarks/results/batch_eval.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402
from batch_throughput import SameImageBackend, plain_docker, running, write_tasks  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.batch import BatchSpec, run_batch  # noqa: E402
from orchestrator.batch import judge as judge_module  # noqa: E402
from orchestrator.batch.judge import JudgeOptions  # noqa: E402
from orchestrator.spec import RunSpec  # noqa: E402
from tests.model_server import ScriptedModelServer  # noqa: E402

PAYLOAD = REPO / "tests" / "payloads" / "batch_math"
RESULTS = REPO / "benchmarks" / "results"
ATTEMPTS = 100


def host_cpu() -> float:
    """CPU seconds of this process and its waited-for children so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class JudgeTimer:
    """Times each judge call the batch makes (`Judge.ask`, wrapped for this run only)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._ask: Callable[..., Any] = judge_module.Judge.ask

    def __enter__(self) -> JudgeTimer:
        timer, ask = self, self._ask

        def timed(judge: Any, prompt: str) -> Any:
            started = time.perf_counter()
            try:
                return ask(judge, prompt)
            finally:
                timer.seconds.append(time.perf_counter() - started)

        judge_module.Judge.ask = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        judge_module.Judge.ask = self._ask  # type: ignore[method-assign]


def one_batch(
    kind: str, out: Path, backend: Any, concurrency: int, judge: JudgeOptions | None
) -> dict[str, Any]:
    """One of the three batch shapes, 100 attempts each; its figures."""
    n, epochs = (20, 5) if kind == "epochs" else (ATTEMPTS, 1)
    spec = BatchSpec(
        tasks=write_tasks(out.with_suffix(".jsonl"), n),
        output=out,
        run=RunSpec(payload=PAYLOAD),
        concurrency=concurrency,
        epochs=epochs,
        scorer=("exact", "model") if kind == "judge" else "exact",
        judge=judge if kind == "judge" else None,
    )
    cpu, started = host_cpu(), time.monotonic()
    with JudgeTimer() as timer:
        summary = run_batch(spec, backend=backend)
    wall = time.monotonic() - started
    figures: dict[str, Any] = {
        "wall_seconds": round(wall, 2),
        "attempts_per_minute": round(ATTEMPTS / wall * 60, 1),
        "host_cpu_per_attempt": round((host_cpu() - cpu) / ATTEMPTS, 4),
        "correct": summary.correct,
        "counts": summary.counts,
    }
    if epochs > 1:
        reducers = summary.epoch_metrics.get("reducers", {})
        figures["pass_at"] = {k: v for k, v in reducers.items() if k.startswith("pass_at")}
    if timer.seconds:
        figures["judge_calls"] = len(timer.seconds)
        figures["judge_p50_ms"] = round(statistics.median(timer.seconds) * 1000, 1)
        figures["judge_p95_ms"] = round(
            sorted(timer.seconds)[int(0.95 * (len(timer.seconds) - 1))] * 1000, 1
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="rounds of the four")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="batch-eval-"))
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")  # a private store
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    env = workdir / "judge.env"
    env.write_text("OPENAI_API_KEY=sk-benchmark-judge\n")
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    backend = SameImageBackend(client, image)
    kinds = ("floor", "one_epoch", "epochs", "judge")
    rounds: list[dict[str, Any]] = []
    with ScriptedModelServer([], answer=lambda _body: "The answer matches. GRADE: C") as server:
        judge = JudgeOptions("openai:judge-1", server.api_base(), env_file=env)
        plain_docker(image, 2, 2)  # warm both paths (page cache, image layers)
        one_batch("one_epoch", workdir / "warmup", backend, 2, None)
        for i in range(args.repeat):
            order = kinds[i % 4 :] + kinds[: i % 4]  # each kind goes first in turn
            measured: dict[str, Any] = {}
            for kind in order:
                before = {"load_1m": context.load(), "containers": running(client)}
                if kind == "floor":
                    cpu = host_cpu()
                    floor = plain_docker(image, ATTEMPTS, args.concurrency)
                    floor["attempts_per_minute"] = round(floor.pop("tasks_per_minute"), 1)
                    floor["host_cpu_per_attempt"] = round((host_cpu() - cpu) / ATTEMPTS, 4)
                    measured[kind] = floor
                else:
                    out = workdir / f"{kind}-r{i}"
                    measured[kind] = one_batch(kind, out, backend, args.concurrency, judge)
                measured[kind]["before"] = before
                print(f"round {i + 1} {kind}: {measured[kind]}", flush=True)
            rounds.append(measured)

    def median(kind: str, key: str) -> float | None:
        values = [r[kind][key] for r in rounds if key in r[kind]]
        return round(statistics.median(values), 4) if values else None

    rows = {
        kind: {
            key: median(kind, key)
            for key in (
                "wall_seconds",
                "attempts_per_minute",
                "host_cpu_per_attempt",
                "judge_p50_ms",
                "judge_p95_ms",
            )
        }
        for kind in kinds
    }
    report = {
        "what": f"{ATTEMPTS} attempts of the mock batch_math task at concurrency "
        f"{args.concurrency}, runc",
        "image": image,
        **context.header(client),
        "results": rows,
        "rounds": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batch_eval.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    labels = {
        "floor": "bare `docker run --rm`, 100 tasks",
        "one_epoch": "`batch`, 100 tasks",
        "epochs": "`batch --epochs 5`, 20 tasks",
        "judge": "`batch --scorer exact --scorer model`, 100 tasks",
    }
    one = rows["one_epoch"]
    lines = [
        "# Evaluation batches: epochs and a model judge",
        "",
        f"{report['what']}; {context.summary(report)}. Host CPU: this process and its "
        "children (the sandboxes' own CPU is not in it); judge latency: each `Judge.ask` as "
        "the batch saw it, a scripted judge on this host answering at once.",
        "",
        "| what | attempts/min | vs one epoch | host CPU s/attempt | judge p50 / p95 (ms) |",
        "|---|---|---|---|---|",
    ]
    for kind in kinds:
        row = rows[kind]
        ratio = (row["attempts_per_minute"] or 0) / (one["attempts_per_minute"] or 1)
        judge_text = (
            f"{row['judge_p50_ms']:.1f} / {row['judge_p95_ms']:.1f}"
            if row["judge_p50_ms"] is not None
            else "-"
        )
        lines.append(
            f"| {labels[kind]} | {row['attempts_per_minute']:.1f} | {ratio:.2f} "
            f"| {row['host_cpu_per_attempt']:.3f} | {judge_text} |"
        )
    lines += [
        "",
        f"Median of {args.repeat} round(s), the four in a turning order; every round's "
        "figures and the load average before each are in batch_eval.json.",
    ]
    (RESULTS / "batch_eval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
