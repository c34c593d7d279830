"""A batch on a one-node Ray cluster against the same batch on this machine, side by side in
one run, at the same concurrency; the Ray overhead per attempt; the driver's maximum rate of
finished attempts (bookkeeping alone, with a stand-in executor that starts no sandbox); the
bytes of a run's record (issue 23, acceptance 3; docs/SCALING.md quotes the figures).

Run by hand (not a test; ~5 minutes on 2 cores by default):

    python benchmarks/ray_batch.py [--tasks 24] [--concurrency 2] [--rounds 2]
                                   [--bookkeeping 2000]

Starts its own one-node cluster (`ray start --head --block`, its own temp and state
directories, stopped at the end) with `orchestrator_sandboxes` = the concurrency. Writes
benchmarks/results/ray_batch.json and .md. Rounds alternate which side goes first; the load
average before each measurement is recorded, so a busy machine shows in the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402

from orchestrator.batch import BatchSpec, run_batch  # noqa: E402
from orchestrator.cluster import RayExecutor  # noqa: E402
from orchestrator.cluster.transfer import import_record  # noqa: E402
from orchestrator.execution.executor import Attempt, AttemptExecutor, LocalExecutor  # noqa: E402
from orchestrator.lifecycle.runner import PreparedRun, RunObservers  # noqa: E402
from orchestrator.records.store import Store  # noqa: E402
from orchestrator.spec import RunResult, RunSpec  # noqa: E402
from tests.ray_cluster import start_node  # noqa: E402

PAYLOAD = REPO / "tests" / "payloads" / "batch_math"
RESULTS = REPO / "benchmarks" / "results"


def write_tasks(path: Path, n: int) -> Path:
    rows = [
        {
            "id": f"q{i:05d}",
            "task": f"What is {i + 2} * {i % 7 + 3}?",
            "additional_args": {"op": "mul", "a": i + 2, "b": i % 7 + 3},
            "expected": (i + 2) * (i % 7 + 3),
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class TimedRay(RayExecutor):
    """The Ray executor with the driver's side of each attempt timed: the `reserve` round
    trip, and `run` from the call to the record in the driver's store."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.runs: list[tuple[float, RunResult]] = []
        self.reserves: list[float] = []
        self.lock = threading.Lock()

    def reserve(self, prepared: PreparedRun, **kwargs: Any) -> Attempt:
        started = time.perf_counter()
        attempt = super().reserve(prepared, **kwargs)
        with self.lock:
            self.reserves.append(time.perf_counter() - started)
        return attempt

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        started = time.perf_counter()
        result = super().run(attempt, observers)
        with self.lock:
            self.runs.append((time.perf_counter() - started, result))
        return result


def one_batch(executor: AttemptExecutor, tasks: Path, out: Path, concurrency: int) -> dict:
    before = context.load()
    started = time.perf_counter()
    summary = run_batch(
        BatchSpec(tasks=tasks, output=out, run=RunSpec(payload=PAYLOAD), concurrency=concurrency),
        executor=executor,
    )
    wall = time.perf_counter() - started
    assert summary.counts.get("succeeded") == summary.total, summary.counts
    return {
        "tasks_per_min": round(summary.total / wall * 60, 1),
        "wall_s": round(wall, 2),
        "load_1m_before": before,
    }


def overhead(executor: TimedRay) -> dict:
    """Per attempt: the driver's wall time of `run` minus the run's own span on its node
    (record created to ended): shipping the attempt, the node's worker, packing the record,
    bringing it back and writing it into the driver's store."""
    extra = [
        wall - (r.timings["ended"] - r.timings["created"])
        for wall, r in executor.runs
        if r.timings.get("created") and r.timings.get("ended")
    ]
    extra.sort()
    return {
        "attempts": len(extra),
        "p50_ms": round(statistics.median(extra) * 1000, 1),
        "p95_ms": round(extra[int(0.95 * (len(extra) - 1))] * 1000, 1),
        "reserve_p50_ms": round(statistics.median(executor.reserves) * 1000, 1),
    }


class StandIn(AttemptExecutor):
    """Starts no sandbox: each attempt's record is a copy of a real node's packed record,
    written into the driver's store as `RayExecutor` does (`import_record`). What is left is
    the driver's own work per finished attempt: attempts and results lines, the score, the
    record's files and its index row."""

    def __init__(self, packed: dict[str, Any]) -> None:
        self.packed = packed

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        assert observers.store is not None
        row = {**self.packed["row"], "run_id": attempt.run_id, "batch": attempt.prepared.spec.batch}
        answer = json.loads(self.packed["files"]["result.json"])
        args = attempt.prepared.spec.additional_args or {}
        answer.update(run_id=attempt.run_id, answer=args.get("a", 0) * args.get("b", 0))
        files = {**self.packed["files"], "result.json": json.dumps(answer).encode()}
        return import_record(observers.store, {"row": row, "files": files}, {"node_id": "x"})


def sqlite_rate(root: Path, n: int = 2000) -> dict:
    """The run index alone: a run's two writes (its row created, then ended), one
    transaction each, from one thread, as every run makes them."""
    store = Store(root)
    started = time.perf_counter()
    for i in range(n):
        run_id = f"r-bench-{i:06d}"
        store.create_run(run_id, status="running", payload="p", model="m", batch="b")
        store.update_run(run_id, status="succeeded", ended_at=time.time(), duration=1.0)
    wall = time.perf_counter() - started
    return {"runs": n, "runs_per_s": round(n / wall, 1), "writes_per_s": round(2 * n / wall, 1)}


def record_bytes(store: Store, run_ids: list[str]) -> dict:
    sizes = []
    for run_id in run_ids:
        folder = store.run_dir(run_id)
        sizes.append(sum(p.stat().st_size for p in folder.iterdir() if p.is_file()))
    return {
        "runs": len(sizes),
        "mean_bytes": round(statistics.mean(sizes)),
        "max_bytes": max(sizes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--bookkeeping", type=int, default=2000, help="tasks of the stand-in batch (no sandbox)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    os.environ["ORCHESTRATOR_HOME"] = str(work / "driver")
    os.environ.setdefault("ORCHESTRATOR_SANDBOX_RUNTIME", "runc")
    tasks = write_tasks(work / "tasks.jsonl", args.tasks)
    head, address = start_node(work, "head", sandboxes=args.concurrency)
    rounds: list[dict] = []
    timed: TimedRay | None = None
    try:
        for n in range(args.rounds):
            order = ["local", "ray"] if n % 2 == 0 else ["ray", "local"]
            figures = {}
            for side in order:
                out = work / f"out-{side}-{n}"
                if side == "local":
                    figures[side] = one_batch(LocalExecutor(), tasks, out, args.concurrency)
                else:
                    timed = TimedRay(address)
                    figures[side] = one_batch(timed, tasks, out, args.concurrency)
                print(f"round {n + 1} {side}: {figures[side]}", file=sys.stderr)
            rounds.append(figures)
        assert timed is not None
        ray_overhead = overhead(timed)
        store = Store()
        ran = [r.run_id for _, r in timed.runs if r.status == "succeeded"]
        sizes = record_bytes(store, ran)
        from orchestrator.cluster.transfer import pack_record

        packed = pack_record(store, ran[-1])
    finally:
        head.kill()
    book_tasks = write_tasks(work / "book.jsonl", args.bookkeeping)
    started = time.perf_counter()
    summary = run_batch(
        BatchSpec(
            tasks=book_tasks, output=work / "out-book", run=RunSpec(payload=PAYLOAD), concurrency=16
        ),
        executor=StandIn(packed),
    )
    book_wall = time.perf_counter() - started
    assert summary.counts.get("succeeded") == args.bookkeeping, summary.counts
    bookkeeping = {
        "tasks": args.bookkeeping,
        "concurrency": 16,
        "attempts_per_s": round(args.bookkeeping / book_wall, 1),
        "wall_s": round(book_wall, 2),
    }
    index = sqlite_rate(work / "index-only")
    local = statistics.median(r["local"]["tasks_per_min"] for r in rounds)
    ray = statistics.median(r["ray"]["tasks_per_min"] for r in rounds)
    report = {
        **context.header(),
        "python": platform.python_version(),
        "tasks": args.tasks,
        "concurrency": args.concurrency,
        "rounds": rounds,
        "local_tasks_per_min": local,
        "ray_tasks_per_min": ray,
        "ray_over_local": round(ray / local, 2),
        "ray_overhead": ray_overhead,
        "bookkeeping": bookkeeping,
        "record": sizes,
        "sqlite": index,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ray_batch.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# A batch on a one-node Ray cluster against the same batch on this machine",
        "",
        f"{args.tasks} mock tasks (batch_math, one CodeAgent step each) at concurrency "
        f"{args.concurrency}; {context.summary(report)}. "
        "`local` = `orchestrator batch`; `ray` = the same with `--ray` on a one-node cluster "
        "on this machine (`orchestrator_sandboxes` = the concurrency). Median of "
        f"{args.rounds} round(s), the side that goes first alternating.",
        "",
        "| side | tasks/min (median) | every round | load avg before |",
        "|---|---|---|---|",
        f"| local | {local} | {[r['local']['tasks_per_min'] for r in rounds]} | "
        f"{[r['local']['load_1m_before'] for r in rounds]} |",
        f"| ray | {ray} | {[r['ray']['tasks_per_min'] for r in rounds]} | "
        f"{[r['ray']['load_1m_before'] for r in rounds]} |",
        "",
        f"ray / local: **{report['ray_over_local']}x**.",
        "",
        f"Ray overhead per attempt (driver's `run` minus the run's own span on its node, "
        f"{ray_overhead['attempts']} attempts): p50 {ray_overhead['p50_ms']} ms, p95 "
        f"{ray_overhead['p95_ms']} ms; `reserve` (the node's run id, which includes waiting "
        f"for its warm sandbox, as a local batch waits too) p50 "
        f"{ray_overhead['reserve_p50_ms']} ms.",
        "",
        f"Driver bookkeeping with a stand-in executor that starts no sandbox (each attempt's "
        f"record a copy of a real node's, written into the store as `--ray` does): "
        f"**{bookkeeping['attempts_per_s']} finished attempts/s** ({args.bookkeeping} tasks "
        "at concurrency 16).",
        "",
        f"The run index alone (SQLite, WAL): {index['writes_per_s']} write transactions/s "
        f"from one thread, {index['runs_per_s']} runs/s at two writes a run.",
        "",
        f"Record per run: mean {sizes['mean_bytes']} bytes, max {sizes['max_bytes']} bytes "
        f"(events, logs, result.json; {sizes['runs']} runs) plus one index row.",
    ]
    (RESULTS / "ray_batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
