"""The cold path against the floor: `orchestrator run` of the trivial payload (mock model, one
CodeAgent step) under runc and under gVisor, next to a bare runc `docker run` of the same
agent image (the floor) and a bare gVisor one, interleaved in one run. The gVisor run goes
cold (snapshots off) and, where the engine offers checkpoints (experimental mode:
scripts/enable-checkpoints.sh), restored from its snapshot too.

Each `orchestrator run` is also split into its phases, from its record and the clock around
the process: the host's start-up (interpreter, imports, checks, the run record), image check
and container creation, the sandbox's start up to the runtime's first event (the engine's
start, the deadline keeper, the runtime's imports, the request), the agent, and the end (the
sandbox's exit and removal, the record, the process's exit); and the host process's CPU
seconds. One `-X importtime` run names what the host's start-up imports.

Run by hand (not a test; about 2 minutes on 2 cores, more on a busy machine):

    python benchmarks/cold_start.py [--rounds 7] [--as-is]

The package is byte-compiled first (`compileall`), as pip installs it: an environment with
PYTHONDONTWRITEBYTECODE set (CI's, this project's machines) otherwise compiles the host's
modules on every run (`--as-is` measures it so). Needs gVisor registered for the gVisor
rows (`sudo bash scripts/setup-gvisor.sh`); without it they are left out. Writes
benchmarks/results/cold_start.json and .md; the load average before the rounds and after
them is recorded, so a busy machine shows in the figures.
"""

from __future__ import annotations

import argparse
import collections
import compileall
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402
from batch_throughput import AGENT_SCRIPT  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.backends.docker.seccomp import gvisor_profile_text  # noqa: E402

PAYLOAD = REPO / "tests" / "payloads" / "batch_math"
RESULTS = REPO / "benchmarks" / "results"
RUN_ARGS = ["run", str(PAYLOAD), "mul", "--arg", 'op="mul"', "--arg", "a=6", "--arg", "b=7"]
PHASES = ("host start-up", "image + create", "start -> run_start", "agent", "end")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def docker_run(image: str, runtime: str, options: tuple[str, ...] = ()) -> dict[str, float]:
    """The floor: `docker run --rm` of the same image and agent, nothing else."""
    started = time.perf_counter()
    out = subprocess.run(
        ["docker", "run", "--rm", "--runtime", runtime, *options, image, "python", "-c"]
        + [AGENT_SCRIPT, "6", "7"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.perf_counter() - started
    if out.returncode != 0 or out.stdout.strip().splitlines()[-1] != "42":
        raise SystemExit(f"docker run ({runtime}) went wrong: {out.stderr[-500:]}")
    return {"total": took}


def orchestrator_run(
    image: str,
    runtime: str | None,
    snapshot: bool = False,
    options: tuple[str, ...] = (),
    head_start: bool | None = None,
) -> dict[str, float]:
    """`orchestrator run` as a user types it (`--sandbox-runtime runc`, or the default), its
    total and its phases. `snapshot`: the default (gVisor) run restored from a snapshot, which
    the engine must offer; otherwise snapshots are off (ORCHESTRATOR_SNAPSHOTS), a cold start.
    `options`: more of `run`'s flags (a network policy, say). `head_start` (runsc-direct):
    True, the restore must have begun at the command's start (its payload ran before);
    False, head starts off (ORCHESTRATOR_HEAD_START); None, as it comes."""
    argv = [sys.executable, "-m", "orchestrator", *RUN_ARGS, *options, "--json", "--quiet"]
    argv += ["--sandbox-runtime", runtime] if runtime else []
    env = {**os.environ, "ORCHESTRATOR_SNAPSHOTS": "on" if snapshot else "off"}
    if head_start is False:
        env["ORCHESTRATOR_HEAD_START"] = "off"
    cpu = children_cpu()
    spawned = time.time()
    started = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    took = time.perf_counter() - started
    ended = time.time()
    cpu = children_cpu() - cpu
    result = json.loads(out.stdout or "{}")
    if out.returncode != 0 or result.get("answer") != 42 or result.get("image") != image:
        raise SystemExit(f"orchestrator run ({runtime}) went wrong: {out.stderr[-800:]}")
    if runtime is None and result["sandbox"]["runtime"] != "runsc":
        raise SystemExit(f"the default run was not on gVisor: {result['sandbox']}")
    if snapshot != bool(result["sandbox"].get("snapshot")):
        raise SystemExit(f"snapshot {snapshot}, but the run's sandbox was {result['sandbox']}")
    if head_start is not None and head_start != ("restore_begun" in result["sandbox"]):
        raise SystemExit(f"head start {head_start}, but the run's sandbox was {result['sandbox']}")
    events = {}
    for line in (Path(result["record_dir"]) / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        events.setdefault(event["type"], event.get("ts"))
    timings = result["timings"]
    return {
        "total": took,
        "host cpu": cpu,
        "host start-up": timings["created"] - spawned,
        "image + create": timings["started"] - timings["created"],
        "start -> run_start": events["run_start"] - timings["started"],
        "agent": events["run_end"] - events["run_start"],
        "end": ended - events["run_end"],
    }


def import_profile(runtime: str) -> dict[str, Any]:
    """What one `orchestrator run` imports, by top-level package (self times summed, ms),
    and the total."""
    argv = [sys.executable, "-X", "importtime", "-m", "orchestrator", *RUN_ARGS, "--json"]
    out = subprocess.run(
        [*argv, "--quiet", "--sandbox-runtime", runtime],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    by_package: collections.Counter[str] = collections.Counter()
    for line in out.stderr.splitlines():
        found = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if found:
            name = found.group(2)
            top = ".".join(name.split(".")[:2]) if name.startswith("orchestrator.") else name
            by_package[top.split(".")[0] if not top.startswith("orchestrator") else top] += int(
                found.group(1)
            )
    return {
        "total_ms": round(sum(by_package.values()) / 1000, 1),
        "modules": sum(1 for line in out.stderr.splitlines() if line.startswith("import time:"))
        - 1,
        "top_ms": {k: round(v / 1000, 1) for k, v in by_package.most_common(12)},
    }


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def has_gvisor(client: Any) -> bool:  # a docker client
    return {"runsc", "runsc-net"} <= set(client.api.info().get("Runtimes") or {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--as-is", action="store_true", help="leave the package's bytecode as it is"
    )
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="cold-bench-"))
    try:
        measure(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the runs' records: read already


def measure(args: argparse.Namespace, workdir: Path) -> None:
    """Every side, interleaved; the results written."""
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE"):  # a script's run: plain output
        os.environ.pop(name, None)
    if not args.as_is:
        for package in ("orchestrator", "orchestrator_runtime"):
            compileall.compile_dir(REPO / package, quiet=1)
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    sides = {
        "docker run (runc)": lambda: docker_run(image, "runc"),
        "orchestrator run (runc)": lambda: orchestrator_run(image, "runc"),
    }
    if has_gvisor(client):
        # Our profile as gVisor reads it: under this runsc (--oci-seccomp) the engine's default
        # profile refuses clone3 with EPERM, and no thread starts.
        profile = workdir / "gvisor-seccomp.json"
        profile.write_text(gvisor_profile_text())
        seccomp = ("--security-opt", f"seccomp={profile}")
        sides["docker run (gVisor)"] = lambda: docker_run(image, "runsc", seccomp)
        sides["orchestrator run (default: gVisor)"] = lambda: orchestrator_run(image, None)
        if client.api.info().get("ExperimentalBuild"):  # checkpoints: scripts/enable-checkpoints.sh
            sides["orchestrator run (default: gVisor, from a snapshot)"] = lambda: orchestrator_run(
                image, None, snapshot=True
            )
    for side in sides.values():
        side()  # the page cache, the image's layers, the store: warm for every side

    figures: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    loads = {"before": context.load()}
    names = list(sides)
    for i in range(args.rounds):  # interleaved, the order turning, so no side is favoured
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            figures[name].append(sides[name]())
        print(
            f"round {i + 1}: "
            + ", ".join(f"{name} {figures[name][-1]['total']:.2f}s" for name in names),
            file=sys.stderr,
        )
    loads["after"] = context.load()
    imports = import_profile("runc")

    floors = [f["total"] for f in figures["docker run (runc)"]]
    rows = {}
    for name, runs in figures.items():
        row = {key: median([run[key] for run in runs]) for key in runs[0]}
        row["x floor"] = round(row["total"] / median(floors), 3)
        # Each round's own ratio (its runs were seconds apart): steadier on a busy machine.
        row["x floor per round"] = median(
            [r["total"] / f for r, f in zip(runs, floors, strict=True)]
        )
        rows[name] = row
    report = {
        "what": "trivial CodeAgent (batch_math mul: one scripted step, mock model), same image "
        "everywhere; the floor is a bare runc `docker run --rm <image> python -c <agent>`",
        "image": image,
        **context.header(client),
        "rounds": args.rounds,
        "bytecode": "as found" if args.as_is else "compiled",
        "load_1m": loads,
        "medians_seconds": rows,
        "all_seconds": {
            name: [{k: round(v, 3) for k, v in run.items()} for run in runs]
            for name, runs in figures.items()
        },
        "host_imports_runc_run": imports,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cold_start.json").write_text(json.dumps(report, indent=2) + "\n")
    ours = [name for name in rows if name.startswith("orchestrator")]
    lines = [
        "# The cold path",
        "",
        f"{report['what']}; {context.summary(report)}; {args.rounds} interleaved rounds, medians; "
        f"host bytecode {report['bytecode']}; load average {loads}.",
        "",
        "| path | median (s) | x bare runc `docker run` | median of each round's ratio |",
        "|---|---|---|---|",
        *(
            f"| {name} | {row['total']:.3f} | {row['x floor']:.2f} | "
            f"{row['x floor per round']:.2f} |"
            for name, row in rows.items()
        ),
        "",
        "Where each `orchestrator run` spends it (medians, s; the phases of different rounds "
        "do not add up to the median total exactly):",
        "",
        f"| phase | {' | '.join(ours)} |",
        f"|---|{'---|' * len(ours)}",
        *(
            f"| {phase} | {' | '.join(f'{rows[name][phase]:.3f}' for name in ours)} |"
            for phase in (*PHASES, "host cpu")
        ),
        "",
        f"The host's imports in one runc run: {imports['modules']} modules, "
        f"{imports['total_ms']} ms (`-X importtime`, self times); the most: "
        + ", ".join(f"{k} {v}" for k, v in list(imports["top_ms"].items())[:8])
        + ".",
        "",
    ]
    (RESULTS / "cold_start.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
