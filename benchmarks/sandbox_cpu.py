"""What one sandbox costs, warm against cold (issue 28): each sandbox's own CPU, read from
its container's cgroup (`cpuacct.usage`, cgroup v1 as on these machines), over a batch of
mock tasks at one concurrency, warm and cold back to back (the first side alternating).

Where `saturation.py` says how much CPU a task costs the host, this says how much of it is
the sandboxes' own (the runtime, and under gVisor its kernel) and, for a warm sandbox, how
much of that it spent before its request came and how long it idled: whether a warm
sandbox costs more than a cold one, or the rest of the host does (engine, shims, storage).

    python benchmarks/sandbox_cpu.py [--tasks 64] [--config fixed4] [--rounds 2]
                                     [--runtime auto|runc|runsc] [--name sandbox_cpu]

The cgroups are sampled every 50 ms, so the last moments of each sandbox are missed alike
on both sides; the sampling's own CPU is the orchestrator's. Writes
benchmarks/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402
from saturation import RESULTS, label, one_batch, save, setup, teardown  # noqa: E402

from orchestrator.backends.docker.sandbox import DockerSandbox  # noqa: E402

CGROUPS = Path("/sys/fs/cgroup/cpuacct/docker")
SAMPLE_SECONDS = 0.05


class SandboxClock:
    """Each container's CPU over time (its cgroup, sampled), and when each sandbox became
    ready (warm only) and received its request: DockerSandbox's methods wrapped, not
    changed."""

    def __init__(self) -> None:
        self.usage: dict[str, list[tuple[float, int]]] = {}
        self.marks: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._wrap()
        self._thread.start()

    def _wrap(self) -> None:
        wait_idle, start = DockerSandbox.wait_idle, DockerSandbox.start
        marks = self.marks

        def timed_wait_idle(sandbox: DockerSandbox, timeout: float) -> None:
            wait_idle(sandbox, timeout)
            marks.setdefault(sandbox.id, {})["ready"] = time.monotonic()

        def timed_start(sandbox: DockerSandbox, request, secrets) -> None:
            marks.setdefault(sandbox.id, {})["request"] = time.monotonic()
            start(sandbox, request, secrets)

        DockerSandbox.wait_idle = timed_wait_idle  # type: ignore[method-assign]
        DockerSandbox.start = timed_start  # type: ignore[method-assign]

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            now = time.monotonic()
            for group in CGROUPS.glob("?" * 64):
                try:
                    used = int((group / "cpuacct.usage").read_text())
                except (OSError, ValueError):  # gone meanwhile
                    continue
                self.usage.setdefault(group.name, []).append((now, used))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, ids: list[str]) -> dict[str, float]:
        """Per sandbox that received a request: CPU seconds in all, before the request, and
        seconds idle between ready and request (means over the sandboxes)."""
        rows = []
        for cid in ids:
            series, marks = self.usage.get(cid, []), self.marks.get(cid, {})
            if not series or "request" not in marks:
                continue  # not a sandbox of a run (the batch's check, a helper)
            before = max((u for t, u in series if t <= marks["request"]), default=0)
            idle = marks["request"] - marks["ready"] if "ready" in marks else 0.0
            rows.append((max(u for _, u in series) / 1e9, before / 1e9, idle))
        if not rows:
            return {"sandboxes": 0}
        return {
            "sandboxes": len(rows),
            "cpu_seconds": round(statistics.mean(r[0] for r in rows), 3),
            "cpu_seconds_before_request": round(statistics.mean(r[1] for r in rows), 3),
            "idle_seconds": round(statistics.mean(r[2] for r in rows), 3),
        }


def write(report: dict) -> None:
    lines = [
        "# What one sandbox costs, warm against cold",
        "",
        f"{report['tasks']} mock tasks at {label(report['config'])}; {report['runtime']} "
        f"runtime; {context.summary(report, started=True)}. Host CPU per task "
        "from /proc/stat (of which the orchestrator's process and the engine's daemons); "
        "a sandbox's own CPU from its cgroup (mean over the batch's run sandboxes), the part "
        "before its request, and how long a warm one idled between ready and request.",
        "",
        "| round | side | tasks/min | host CPU s/task | orchestrator | engine | sandbox CPU s "
        "| of it before the request | idle s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        b, s = row["batch"], row["sandboxes"]
        lines.append(
            f"| {row['round']} | {row['side']} | {b['tasks_per_minute']} "
            f"| {b['cpu_seconds_per_task']} | {b['orchestrator_cpu_per_task']} "
            f"| {b['engine_cpu_per_task']} | {s.get('cpu_seconds', '-')} "
            f"| {s.get('cpu_seconds_before_request', '-')} | {s.get('idle_seconds', '-')} |"
        )
    save(report["name"], report, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--config", default="fixed4", help="as saturation.py's --configs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runtime", choices=["auto", "runc", "runsc"], default="runsc")
    parser.add_argument("--name", default="sandbox_cpu", help="results file name")
    args = parser.parse_args()
    if not CGROUPS.is_dir():
        sys.exit(f"{CGROUPS} is missing: this measures cgroup v1 containers of Docker")
    workdir, backend, _ = setup()
    runtime = None if args.runtime == "auto" else args.runtime
    report: dict = {
        "name": args.name,
        "tasks": args.tasks,
        "config": args.config,
        "runtime": args.runtime,
        **context.header(backend.client),
        "results": [],
    }
    clock = SandboxClock()
    try:
        (workdir / "warmup").mkdir()
        one_batch(4, "fixed2", True, workdir / "warmup", backend, runtime)
        for r in range(args.rounds):
            for side in ("warm", "cold") if r % 2 == 0 else ("cold", "warm"):
                time.sleep(5)
                seen = set(clock.usage)
                out = workdir / f"{r}-{side}"
                out.mkdir()
                batch = one_batch(args.tasks, args.config, side == "warm", out, backend, runtime)
                time.sleep(1)  # the last samples
                ids = [cid for cid in clock.usage if cid not in seen]
                row = {
                    "round": r + 1,
                    "side": side,
                    "batch": batch,
                    "sandboxes": clock.summary(ids),
                }
                report["results"].append(row)
                write(report)
                print(
                    f"round {r + 1} {side}: {batch['tasks_per_minute']}/min, {row['sandboxes']}",
                    flush=True,
                )
    finally:
        clock.stop()
        teardown(workdir, backend.client)
    print((RESULTS / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
