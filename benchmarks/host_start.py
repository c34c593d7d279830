"""The host's part of a cold run: what `orchestrator run` does before its sandbox's container
is created (the interpreter, orchestrator's modules and the Docker SDK, the payload's checks,
the engine calls, the run record, the image check), under runc and under gVisor (the default
where it is registered), next to a bare `docker run` of the same agent image on each, and,
with `--before REF`, the same runs of the code at a git commit REF, all interleaved in one
run.

"Host before create" is the time from the process's spawn to the moment the runner asked the
backend for the sandbox, from the run record's timings (`created`, when the record was
opened, plus `image_seconds`, the image check after it); "python start-up" is a bare
interpreter's spawn to its first statement (site's imports included), the part no change of
ours can take away. The host process's CPU seconds are the whole run's.

Run by hand (not a test; about 3 minutes on 2 cores, more on a busy machine):

    python benchmarks/host_start.py [--rounds 9] [--before REF]

Each tree is byte-compiled first, as pip installs it (see cold_start.py). Writes
benchmarks/results/host_start.json and .md.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import statistics
import subprocess
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
from cold_start import RUN_ARGS, docker_run, has_gvisor  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.backends.docker.seccomp import gvisor_profile_text  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def python_start() -> dict[str, float]:
    """A bare interpreter of the same environment: spawn to its first statement."""
    spawned = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "import time; print(repr(time.time()))"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    return {"total": float(out.stdout) - spawned}


def orchestrator_run(tree: Path, image: str, runtime: str | None) -> dict[str, float]:
    """`orchestrator run` of the code in `tree`, as a user types it (`--sandbox-runtime runc`,
    or the default: gVisor, from its snapshot where the engine offers checkpoints)."""
    argv = [sys.executable, "-m", "orchestrator", *RUN_ARGS, "--json", "--quiet"]
    argv += ["--sandbox-runtime", runtime] if runtime else []
    cpu = children_cpu()
    spawned = time.time()
    started = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tree)
    took = time.perf_counter() - started
    cpu = children_cpu() - cpu
    result = json.loads(out.stdout or "{}")
    if out.returncode != 0 or result.get("answer") != 42 or result.get("image") != image:
        raise SystemExit(f"orchestrator run ({tree}, {runtime}) went wrong: {out.stderr[-800:]}")
    if runtime is None and result["sandbox"]["runtime"] != "runsc":
        raise SystemExit(f"the default run was not on gVisor: {result['sandbox']}")
    timings = result["timings"]
    return {
        "total": took,
        "host before create": timings["created"] + timings["image_seconds"] - spawned,
        "image check": timings["image_seconds"],
        "host cpu": cpu,
    }


def checkout(ref: str, into: Path) -> Path:
    """The repository's tree at `ref` (git archive), byte-compiled."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", ref], cwd=REPO, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--before", metavar="REF", help="also run the code at this git commit")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="host-start-bench-"))
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
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "ORCHESTRATOR_SNAPSHOTS"):
        os.environ.pop(name, None)  # a script's run, the defaults
    trees = {"": REPO}
    if args.before:
        trees = {f"before ({args.before})": checkout(args.before, workdir / "before"), **trees}
    for tree in trees.values():
        for package in ("orchestrator", "orchestrator_runtime"):
            compileall.compile_dir(tree / package, quiet=1)
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    gvisor = has_gvisor(client)
    sides: dict[str, Callable[[], dict[str, float]]] = {
        "python start-up": python_start,
        "docker run (runc)": lambda: docker_run(image, "runc"),
    }
    if gvisor:
        profile = workdir / "gvisor-seccomp.json"  # our profile, as cold_start.py says why
        profile.write_text(gvisor_profile_text())
        seccomp = ("--security-opt", f"seccomp={profile}")
        sides["docker run (gVisor)"] = lambda: docker_run(image, "runsc", seccomp)
    for label, tree in trees.items():
        suffix = f", {label}" if label else ""
        sides[f"orchestrator run (runc{suffix})"] = lambda t=tree: orchestrator_run(
            t, image, "runc"
        )
        if gvisor:
            sides[f"orchestrator run (default: gVisor{suffix})"] = lambda t=tree: orchestrator_run(
                t, image, None
            )
    for side in sides.values():
        side()  # the page cache, the image's layers, the store, the snapshot: warm for all

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
    write(args, client, image, figures, loads)


def write(
    args: argparse.Namespace,
    client: Any,
    image: str,
    figures: dict[str, list[dict[str, float]]],
    loads: dict[str, float],
) -> None:
    floors = [f["total"] for f in figures["docker run (runc)"]]
    rows = {}
    for name, runs in figures.items():
        row = {key: median([run[key] for run in runs]) for key in runs[0]}
        row["x floor per round"] = median(
            [r["total"] / f for r, f in zip(runs, floors, strict=True)]
        )
        rows[name] = row
    report = {
        "what": "trivial CodeAgent (batch_math mul: one scripted step, mock model), same image "
        "everywhere; the floor is a bare runc `docker run --rm <image> python -c <agent>`",
        "image": image,
        **context.header(client),
        "before": args.before,
        "rounds": args.rounds,
        "load_1m": loads,
        "medians_seconds": rows,
        "all_seconds": {
            name: [{k: round(v, 3) for k, v in run.items()} for run in runs]
            for name, runs in figures.items()
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "host_start.json").write_text(json.dumps(report, indent=2) + "\n")

    def cell(row: dict[str, float], key: str) -> str:
        return f"{row[key]:.3f}" if key in row else "-"

    lines = [
        "# The host's part of a cold run",
        "",
        f"{report['what']}; {context.summary(report)}; {args.rounds} interleaved rounds, "
        f"medians; load average {loads}.",
        "",
        "| path | total (s) | x bare runc `docker run` (each round's) | host before create (s) "
        "| image check (s) | host CPU (s) |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {row['total']:.3f} | {row['x floor per round']:.2f} | "
            f"{cell(row, 'host before create')} | {cell(row, 'image check')} | "
            f"{cell(row, 'host cpu')} |"
            for name, row in rows.items()
        ),
        "",
        "Host before create: the process's spawn to the runner's call for the sandbox (run "
        "record: `created` + `image_seconds`); python start-up is part of it.",
        "",
    ]
    (RESULTS / "host_start.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
