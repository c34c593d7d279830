"""A batch under gVisor against the same batch under runc (issue: the secure default at full
speed): 64 mock tasks at `--concurrency auto` with the default warm pool, on the default
runtime (`auto`: runsc-direct where the host can run it, gVisor restored by runsc itself),
under gVisor through the engine (restored where the engine can checkpoint) and under runc;
beside them the floor, the same tasks as bare runc `docker run --rm` commands at 4 at once.
Then, at concurrency 1, warm batches on the default and on the engine's gVisor against a
bare runc `docker run` loop.

Sides run in interleaved rounds (the order rotates each round, so no side always follows the
same one); each batch records its wall time, tasks per minute and the host's CPU seconds per
task (busy jiffies of /proc/stat over the batch). The verdicts compare rates pooled over the
rounds (all tasks over all wall time).

    python benchmarks/batch_runtimes.py [--tasks 64] [--rounds 3] [--serial-tasks 24]

Writes benchmarks/results/batch_runtimes.json and .md (batch_runtimes_<driver>.* on a
storage driver other than overlay2). Needs gVisor registered
(scripts/setup-gvisor.sh) and, for the snapshot side, scripts/enable-checkpoints.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402
from batch_throughput import plain_docker  # noqa: E402
from saturation import one_batch, setup, teardown, uptime  # noqa: E402

from orchestrator.execution.hostload import PROC_STAT, cpu_times  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"

#: Each side by name: a warm batch on a runtime, snapshots on or off; or the floor (None).
#: `default` is what a user gets: `auto`, which picks runsc-direct where runsc is installed
#: and the host lets us run it (gVisor restored by runsc itself), else gVisor through the
#: engine; `gvisor` is gVisor through the engine (restored where it can checkpoint).
SIDES: dict[str, tuple[str, bool] | None] = {
    "default": ("auto", True),
    "gvisor": ("runsc", True),
    "runc": ("runc", True),
    "docker_run": None,
}
SERIAL_SIDES: dict[str, tuple[str, bool] | None] = {
    "default_c1": ("auto", True),
    "gvisor_c1": ("runsc", True),
    "docker_run_c1": None,
}
FLOOR_CONCURRENCY = 4


def floor(image: str, n: int, concurrency: int) -> dict:
    """The bare `docker run` loop, with the host's CPU seconds per task as the batches'."""
    stat = PROC_STAT.read_text()
    busy_before, _ = cpu_times(stat)
    measured = plain_docker(image, n, concurrency)
    busy, _ = cpu_times(PROC_STAT.read_text())
    measured["cpu_seconds_per_task"] = round((busy - busy_before) / os.sysconf("SC_CLK_TCK") / n, 3)
    measured["tasks_per_minute"] = round(measured["tasks_per_minute"], 1)
    return measured


def one(side: tuple[str, bool] | None, n: int, config: str, out: Path, backend) -> dict:
    if side is None:
        return floor(backend.image, n, 1 if config == "fixed1" else FLOOR_CONCURRENCY)
    runtime, snapshots_on = side
    os.environ["ORCHESTRATOR_SNAPSHOTS"] = "on" if snapshots_on else "off"
    try:
        return one_batch(n, config, True, out, backend, runtime)
    finally:
        os.environ.pop("ORCHESTRATOR_SNAPSHOTS", None)


def rotated(names: list[str], r: int) -> list[str]:
    shift = r % len(names)
    return names[shift:] + names[:shift]


def pooled_rate(rows: list[dict], side: str) -> float:
    done = [row[side] for row in rows if side in row]
    wall = sum(m["wall_seconds"] for m in done)
    tasks = sum(row["tasks"] for row in rows if side in row)
    return round(tasks / wall * 60, 1) if wall else 0.0


def median_cpu(rows: list[dict], side: str) -> float:
    values = sorted(row[side]["cpu_seconds_per_task"] for row in rows if side in row)
    return values[len(values) // 2] if values else 0.0


def stem(report: dict) -> str:
    """The results' file name: batch_runtimes, with the storage driver when it is not
    overlay2 (what most hosts have)."""
    driver = report.get("storage") or "overlay2"
    return "batch_runtimes" if driver == "overlay2" else f"batch_runtimes_{driver}"


def write(report: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem(report)}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# A batch under gVisor against runc",
        "",
        f"{report['what']}; {context.summary(report, started=True)}; `auto` is "
        f"{report.get('auto', '?')}, the engine's experimental mode "
        f"{'on' if report.get('experimental') else 'off'}. Warm pools (the default) "
        f"at `--concurrency auto`; the floor is bare runc `docker run --rm <same image> python "
        f"-c <same agent>` at {FLOOR_CONCURRENCY} at once (1 at once beside concurrency 1). "
        "Sides interleaved, the order rotating each round; rates pooled over the rounds; CPU "
        "is the host's busy time per task (median). Uptime before / after: "
        f"{report['uptime_before']} / {report.get('uptime_after', '-')}.",
        "",
        "| batch | concurrency | tasks/min (pooled) | x runc batch | CPU s/task | rounds |",
        "|---|---|---|---|---|---|",
    ]
    for group, config in (("auto", "auto"), ("serial", "fixed1")):
        rows = report["results"][group]
        names = list(SIDES if group == "auto" else SERIAL_SIDES)
        runc = pooled_rate(rows, "runc") if group == "auto" else 0.0
        for side in names:
            rate = pooled_rate(rows, side)
            ratio = f"{rate / runc:.2f}" if runc else "-"
            count = sum(1 for row in rows if side in row)
            at_once = (
                "1" if config == "fixed1" else ("auto" if SIDES[side] else str(FLOOR_CONCURRENCY))
            )
            lines.append(
                f"| {side} | {at_once} | {rate} | {ratio} | {median_cpu(rows, side)} | {count} |"
            )
    verdicts = []
    auto_rows = report["results"]["auto"]
    if auto_rows:
        d, g = pooled_rate(auto_rows, "default"), pooled_rate(auto_rows, "gvisor")
        r = pooled_rate(auto_rows, "runc")
        if r:
            verdicts.append(
                f"the default (auto: {report.get('auto', '?')}) / runc at auto: **{d / r:.2f}x** "
                f"(bar: 0.9x); gVisor through the engine / runc: {g / r:.2f}x"
            )
    serial = report["results"]["serial"]
    floor_c1 = pooled_rate(serial, "docker_run_c1") if serial else 0.0
    if floor_c1:
        verdicts.append(
            "warm batch at 1 / bare runc `docker run` loop: the default "
            f"**{pooled_rate(serial, 'default_c1') / floor_c1:.2f}x** (bar: 1.6x), gVisor "
            f"through the engine {pooled_rate(serial, 'gvisor_c1') / floor_c1:.2f}x"
        )
    lines += ["", *[f"- {v}" for v in verdicts], ""]
    (RESULTS / f"{stem(report)}.md").write_text("\n".join(lines))


def measure(args: argparse.Namespace, report: dict, workdir: Path, backend) -> None:
    (workdir / "warmup").mkdir()
    for runtime in ("auto", "runsc", "runc"):  # caches, image layers, the snapshots themselves
        one_batch(4, "fixed2", True, workdir / "warmup", backend, runtime)
    for group, sides, n, config in (
        ("auto", SIDES, args.tasks, "auto"),
        ("serial", SERIAL_SIDES, args.serial_tasks, "fixed1"),
    ):
        for r in range(args.rounds):
            row: dict = {"tasks": n, "round": r + 1}
            report["results"][group].append(row)
            for name in rotated(list(sides), r):
                time.sleep(args.pause)
                out = workdir / f"{group}-{r}-{name}"
                out.mkdir()
                load = context.load()
                row[name] = one(sides[name], n, config, out, backend)
                row[name]["load_before"] = load
                write(report)
                print(
                    f"{group} round {r + 1} {name}: {row[name]['tasks_per_minute']}/min, "
                    f"{row[name]['cpu_seconds_per_task']} CPU s/task (load {load})",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--serial-tasks", type=int, default=24, help="tasks at concurrency 1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between batches")
    args = parser.parse_args()
    workdir, backend, _ = setup()
    report: dict = {
        "what": f"{args.tasks} mock tasks (batch_math, one CodeAgent step each)",
        "image": backend.image,
        "auto": backend.runtime_for("auto"),
        "experimental": bool(backend.client.api.info().get("ExperimentalBuild")),
        **context.header(backend.client),
        "uptime_before": uptime(),
        "results": {"auto": [], "serial": []},
    }
    try:
        measure(args, report, workdir, backend)
    finally:
        teardown(workdir, backend.client)
    report["uptime_after"] = uptime()
    write(report)
    print((RESULTS / f"{stem(report)}.md").read_text())


if __name__ == "__main__":
    main()
