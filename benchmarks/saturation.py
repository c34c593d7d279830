"""Throughput at saturation (issue 28): warm against cold (`--no-warm`) at fixed concurrency 1,
4, 8 and 32 (`--fixed-concurrency`), at `auto` (the default: adapts to the host) and at a
requested 32 (a ceiling: it adapts under it), for 64 and 300 mock tasks, side by side in one
run; plus the host's memory during each batch.

Each configuration runs warm and cold back to back, the side that goes first alternating,
with a pause between measurements; the load average and the running containers are
recorded before each one, and for adaptive runs the limit's range and changes. Results are
written after every measurement (a run cut short keeps what it measured).

    python benchmarks/saturation.py [--tasks 64 300] [--configs auto 32 4 8 1 fixed32]
                                    [--rounds 1] [--pause 5]

`fixed32` is exactly 32 at once (`--fixed-concurrency`), `32` is a requested 32 (a
ceiling), `auto` is the default. Writes benchmarks/results/saturation.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from batch_throughput import PAYLOAD, SameImageBackend, running, tasks  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.batch import BatchSpec, run_batch  # noqa: E402
from orchestrator.hostload import PROC_MEMINFO, memory_mb  # noqa: E402
from orchestrator.spec import RunSpec  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def used_mb() -> int:
    available, total = memory_mb(PROC_MEMINFO.read_text())
    return (total or 0) - (available or 0)


class MemoryWatch:
    """The host's used memory (total - available), sampled every 0.25 s: peak and mean over
    the batch, above what was used before it."""

    def __init__(self) -> None:
        self.base = used_mb()
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            self.samples.append(used_mb())

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        samples = self.samples or [self.base]
        return {
            "before_mb": self.base,
            "peak_above_mb": max(samples) - self.base,
            "mean_above_mb": round(sum(samples) / len(samples) - self.base),
        }


def config_spec(config: str) -> tuple[int | None, bool]:
    """(concurrency, adapt) for a configuration's name."""
    if config == "auto":
        return None, True
    if config.startswith("fixed"):
        return int(config[5:]), False
    return int(config), True


def label(config: str) -> str:
    if config == "auto":
        return "auto"
    if config.startswith("fixed"):
        return f"{config[5:]} (fixed)"
    return f"{config} (requested: a ceiling)"


def one_batch(n: int, config: str, warm: bool, workdir: Path, backend: SameImageBackend) -> dict:
    path = workdir / "tasks.jsonl"
    with open(path, "w") as file:
        for i, (a, b) in enumerate(tasks(n)):
            row = {"id": f"t{i}", "task": "What is a * b?", "expected": a * b,
                   "additional_args": {"op": "mul", "a": a, "b": b}}  # fmt: skip
            file.write(json.dumps(row) + "\n")
    concurrency, adapt = config_spec(config)
    spec = BatchSpec(
        tasks=path, output=workdir / "out", run=RunSpec(payload=PAYLOAD),
        concurrency=concurrency, adapt=adapt, warm=None if warm else 0,
    )  # fmt: skip
    memory = MemoryWatch()
    started = time.monotonic()
    summary = run_batch(spec, backend=backend)
    wall = time.monotonic() - started
    pace = summary.concurrency
    return {
        "wall_seconds": round(wall, 2),
        "tasks_per_minute": round(n / wall * 60, 1),
        "correct": int(summary.correct),
        "counts": {k: v for k, v in summary.counts.items() if v},
        "duration_p50": summary.duration_p50,
        "memory": memory.stop(),
        "concurrency": {k: pace[k] for k in ("mode", "ceiling", "limit", "lowest", "highest")},
        "changes": pace["changes"],
    }


def write(report: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "saturation.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Throughput at saturation: warm against cold, fixed against adaptive concurrency",
        "",
        f"{report['what']}; {report['cpus']} CPUs; Docker {report['docker']}; commit "
        f"{report['commit']}; started {report['date']}. Warm = the default pool; cold = "
        "`--no-warm`. Each configuration ran warm and cold back to back (the first side "
        "alternating), with a pause between; `load` is the 1-minute load average before each "
        "(warm/cold); memory is the host's used memory above what it was before the batch "
        "(peak). Other work shared this machine: compare sides of one row only.",
        "",
        "| tasks | concurrency | warm tasks/min | cold tasks/min | warm / cold | at once "
        "(warm; cold) | memory peak MB (warm / cold) | load before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        w, c = row.get("warm"), row.get("cold")
        if not (w and c):
            continue
        at_once = "; ".join(
            f"{s['concurrency']['lowest']}-{s['concurrency']['highest']}"
            if s["concurrency"]["mode"] == "auto" else str(s["concurrency"]["limit"])
            for s in (w, c)
        )  # fmt: skip
        lines.append(
            f"| {row['tasks']} | {label(row['config'])} | {w['tasks_per_minute']:.1f} "
            f"| {c['tasks_per_minute']:.1f} | {w['tasks_per_minute'] / c['tasks_per_minute']:.2f} "
            f"| {at_once} | {w['memory']['peak_above_mb']} / {c['memory']['peak_above_mb']} "
            f"| {w['before']['load_1m']} / {c['before']['load_1m']} |"
        )
    best: dict[int, float] = {}
    for row in report["results"]:
        if row["config"].startswith("fixed") and row.get("warm") and row.get("cold"):
            rate = max(row["warm"]["tasks_per_minute"], row["cold"]["tasks_per_minute"])
            best[row["tasks"]] = max(best.get(row["tasks"], 0.0), rate)
    if best:
        lines += ["", "Against the best fixed concurrency (its better side) of the same size:", ""]
        for row in report["results"]:
            if row["config"].startswith("fixed") or not (row.get("warm") and row.get("cold")):
                continue
            if row["tasks"] in best:
                lines.append(
                    f"- {row['tasks']} tasks, {label(row['config'])}: warm "
                    f"{row['warm']['tasks_per_minute'] / best[row['tasks']]:.2f}, cold "
                    f"{row['cold']['tasks_per_minute'] / best[row['tasks']]:.2f} of "
                    f"{best[row['tasks']]:.1f} tasks/min"
                )
    lines += ["", f"Uptime before and after: {report.get('uptime_before')} / "
              f"{report.get('uptime_after', 'not finished')}"]  # fmt: skip
    (RESULTS / "saturation.md").write_text("\n".join(lines) + "\n")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[64, 300])
    parser.add_argument(
        "--configs", nargs="+", default=["auto", "32", "fixed4", "fixed8", "fixed32", "fixed1"]
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between batches")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="saturation-bench-"))
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")  # a private store
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    backend = SameImageBackend(client, image)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    report: dict = {
        "what": "mock tasks (batch_math, one CodeAgent step each)",
        "image": image,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "docker": client.version().get("Version"),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "uptime_before": uptime(),
        "results": [],
    }
    (workdir / "warmup").mkdir()
    one_batch(4, "fixed2", True, workdir / "warmup", backend)  # page cache, image layers
    count = 0
    for n in args.tasks:
        for config in args.configs:
            for r in range(args.rounds):
                row: dict = {"tasks": n, "config": config, "round": r + 1}
                report["results"].append(row)
                order = ("warm", "cold") if count % 2 == 0 else ("cold", "warm")
                count += 1
                for side in order:
                    time.sleep(args.pause)
                    out = workdir / f"{n}-{config}-{r}-{side}"
                    out.mkdir()
                    before = {
                        "load_1m": round(os.getloadavg()[0], 2),
                        "containers": running(client),
                        "uptime": uptime(),
                    }
                    row[side] = one_batch(n, config, side == "warm", out, backend)
                    row[side]["before"] = before
                    write(report)
                w, c = row["warm"], row["cold"]
                print(
                    f"{n} tasks, {label(config)}: warm {w['tasks_per_minute']}/min "
                    f"(at once {w['concurrency']['lowest']}-{w['concurrency']['highest']}, "
                    f"mem {w['memory']['peak_above_mb']} MB), cold {c['tasks_per_minute']}/min "
                    f"(at once {c['concurrency']['lowest']}-{c['concurrency']['highest']}, "
                    f"mem {c['memory']['peak_above_mb']} MB); load "
                    f"{w['before']['load_1m']}/{c['before']['load_1m']}",
                    flush=True,
                )
    report["uptime_after"] = uptime()
    write(report)
    print((RESULTS / "saturation.md").read_text())


if __name__ == "__main__":
    main()
