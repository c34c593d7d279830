"""Batch throughput against the floor: tasks per minute for 100 mock tasks at concurrency
1, 2, 4 and 8, as `orchestrator batch` (every task in its own hardened sandbox, recorded,
scored) next to the same tasks as plain `docker run --rm <same image> python -c <script>`
commands at the same concurrency (the DESIGN's floor), measured side by side in one run.

Run by hand on an otherwise idle machine (not a test; ~40 minutes on 2 cores by default):

    python benchmarks/batch_throughput.py [--tasks 100] [--concurrency 1 2 4 8] [--repeat 2]

Writes benchmarks/results/batch_throughput.json and .md. The load average before each
measurement is recorded, so a busy machine shows in the figures.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402

from orchestrator.backends.docker import DockerBackend, connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.batch import BatchSpec, run_batch  # noqa: E402
from orchestrator.spec import RunSpec  # noqa: E402

PAYLOAD = REPO / "tests" / "payloads" / "batch_math"
RESULTS = REPO / "benchmarks" / "results"

#: What the batch_math payload does for {"op": "mul"}, as one self-contained script: a
#: CodeAgent with a scripted model whose one step is `final_answer(a * b)`.
AGENT_SCRIPT = """
import sys
from smolagents import CodeAgent
from smolagents.models import ChatMessage, MessageRole, Model
from smolagents.monitoring import TokenUsage

class Scripted(Model):
    def generate(self, messages, stop_sequences=None, **kwargs):
        return ChatMessage(
            role=MessageRole.ASSISTANT,
            content="Thought: I multiply.\\n<code>\\nfinal_answer(a * b)\\n</code>",
            token_usage=TokenUsage(input_tokens=100, output_tokens=10),
        )

a, b = int(sys.argv[1]), int(sys.argv[2])
agent = CodeAgent(tools=[], model=Scripted(model_id="scripted"), max_steps=3, verbosity_level=0)
print(agent.run("What is a * b?", additional_args={"a": a, "b": b}))
"""


class SameImageBackend(DockerBackend):
    """The Docker backend pinned to the image the floor uses: both sides run the very same
    image, and a runtime edit during the benchmark cannot trigger a build inside a timing."""

    def __init__(self, client, image: str) -> None:  # a docker client
        super().__init__(client)
        self.image = image

    def prepare_image(self, extra_requirements, progress) -> str:
        return self.image


def running(client) -> int:  # a docker client
    """Containers running on the engine (anything not ours shows as load on the figures)."""
    return len(client.api.containers(quiet=True))


def tasks(n: int) -> list[tuple[int, int]]:
    return [(i + 2, i % 7 + 3) for i in range(n)]


def plain_docker(image: str, n: int, concurrency: int) -> dict:
    """The floor: one bare `docker run --rm` per task, `concurrency` at a time."""

    def one(ab: tuple[int, int]) -> bool:
        a, b = ab
        out = subprocess.run(
            ["docker", "run", "--rm", image, "python", "-c", AGENT_SCRIPT, str(a), str(b)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return out.returncode == 0 and out.stdout.strip().splitlines()[-1] == str(a * b)

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        ok = list(pool.map(one, tasks(n)))
    wall = time.monotonic() - started
    return {"wall_seconds": round(wall, 2), "correct": sum(ok), "tasks_per_minute": n / wall * 60}


def write_tasks(path: Path, n: int) -> Path:
    """`tasks(n)` as a tasks file for the batch_math payload."""
    with open(path, "w") as file:
        for i, (a, b) in enumerate(tasks(n)):
            row = {
                "id": f"t{i}",
                "task": "What is a * b?",
                "expected": a * b,
                "additional_args": {"op": "mul", "a": a, "b": b},
            }
            file.write(json.dumps(row) + "\n")
    return path


def orchestrator_batch(n: int, concurrency: int, workdir: Path, backend: DockerBackend) -> dict:
    """The same tasks through `run_batch` (the Python API behind `orchestrator batch`)."""
    path = write_tasks(workdir / f"tasks-{concurrency}.jsonl", n)
    spec = BatchSpec(
        tasks=path,
        output=workdir / f"out-{concurrency}",
        run=RunSpec(payload=PAYLOAD),
        concurrency=concurrency,
    )
    started = time.monotonic()
    summary = run_batch(spec, backend=backend)
    wall = time.monotonic() - started
    return {
        "wall_seconds": round(wall, 2),
        "correct": int(summary.correct),
        "tasks_per_minute": n / wall * 60,
        "counts": summary.counts,
        "duration_p50": summary.duration_p50,
        "duration_p95": summary.duration_p95,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=2, help="rounds per concurrency")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")  # a private store
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    backend = SameImageBackend(client, image)
    # Warm up both paths (page cache, image layers) so the first measurement is not penalised.
    plain_docker(image, 2, 2)
    (workdir / "warmup").mkdir()
    orchestrator_batch(2, 2, workdir / "warmup", backend)

    rows = []
    for concurrency in args.concurrency:
        rounds = []
        for i in range(args.repeat):
            # Alternate which side goes first, so a drift in load does not favour one side.
            order = ("floor", "batch") if i % 2 == 0 else ("batch", "floor")
            measured: dict = {}
            for side in order:
                before = {"load_1m": context.load(), "containers": running(client)}
                if side == "floor":
                    measured[side] = plain_docker(image, args.tasks, concurrency)
                else:
                    out = workdir / f"c{concurrency}-r{i}"
                    out.mkdir()
                    measured[side] = orchestrator_batch(args.tasks, concurrency, out, backend)
                measured[side]["before"] = before
            rounds.append(measured)
            print(
                f"concurrency {concurrency} round {i + 1}: docker run "
                f"{measured['floor']['tasks_per_minute']:.1f}/min, batch "
                f"{measured['batch']['tasks_per_minute']:.1f}/min "
                f"(load {measured['floor']['before']['load_1m']}/"
                f"{measured['batch']['before']['load_1m']})",
                flush=True,
            )
        floor_rate = statistics.median(r["floor"]["tasks_per_minute"] for r in rounds)
        batch_rate = statistics.median(r["batch"]["tasks_per_minute"] for r in rounds)
        rows.append(
            {
                "concurrency": concurrency,
                "docker_run_tasks_per_minute": round(floor_rate, 1),
                "batch_tasks_per_minute": round(batch_rate, 1),
                "ratio": round(batch_rate / floor_rate, 3),
                "batch_run_p50": statistics.median(r["batch"]["duration_p50"] for r in rounds),
                "batch_run_p95": statistics.median(r["batch"]["duration_p95"] for r in rounds),
                "max_load_1m_before": max(
                    r[side]["before"]["load_1m"] for r in rounds for side in ("floor", "batch")
                ),
                "rounds": rounds,
            }
        )

    report = {
        "what": f"{args.tasks} mock tasks (batch_math, one CodeAgent step each)",
        "image": image,
        **context.header(client),
        "results": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batch_throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Batch throughput",
        "",
        f"{report['what']}; {context.summary(report)}. `batch` = `orchestrator batch` (hardened "
        "sandbox, run record, results line, scoring); `docker run` = bare `docker run --rm "
        "<same image> python -c <same agent>`.",
        "",
        "| concurrency | docker run (tasks/min) | batch (tasks/min) | batch / docker run "
        "| batch p50 / p95 run (s) | max load avg before |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['concurrency']} | {row['docker_run_tasks_per_minute']:.1f} "
            f"| {row['batch_tasks_per_minute']:.1f} | {row['ratio']:.2f} "
            f"| {row['batch_run_p50']:.2f} / {row['batch_run_p95']:.2f} "
            f"| {row['max_load_1m_before']:.2f} |"
        )
    lines += [
        "",
        f"Median of {args.repeat} round(s) per concurrency, the side that goes first "
        "alternating; every round's figures, the load average and the number of running "
        "containers before each measurement are in batch_throughput.json.",
    ]
    (RESULTS / "batch_throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
