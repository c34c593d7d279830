"""gVisor run by runsc itself (`--sandbox-runtime runsc-direct`: a new container restored from
the ready snapshot, no dockerd, containerd or shim in the way) against the floor, a bare runc
`docker run --rm` of the same agent image, and against gVisor through the engine
(`--sandbox-runtime runsc`: restored from the engine's snapshot where its experimental mode
is on, else cold) and runc; interleaved in one run. The default's run, as a user gets it,
is restored from a restore begun at the command's very start (its head start: the payload
ran before); beside it the same run with head starts off.

Each `orchestrator run` is split into phases from its record (cold_start.py's): the host's
start-up, image + create (for runsc-direct: the restore is begun here), start -> run_start
(the restored runtime reading its request), the agent, the end. Beside them, the restore
alone, in this process: `runsc restore` of a new container until the restored runtime has
answered an empty request and runsc has exited (no orchestrator start-up, no record).

Run by hand, as root, with runsc installed (not a test; about 3 minutes on 2 cores):

    python benchmarks/runsc_direct.py [--rounds 7]

The run on the default runtime (`auto`, which picks runsc-direct on such a host) is what a
user gets. Writes benchmarks/results/runsc_direct.json and .md (runsc_direct_<driver>.* on a
storage driver other than overlay2), with the engine's experimental mode and the load
average before and after (the figures of a busy machine are slower, and say so).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
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
from cold_start import docker_run, orchestrator_run  # noqa: E402

from orchestrator.backends.base import SandboxSpec  # noqa: E402
from orchestrator.backends.docker import DockerBackend, connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.backends.docker.runsc_direct import direct  # noqa: E402
from orchestrator.labels import run_labels  # noqa: E402
from orchestrator.spec import Limits, NetworkPolicy  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def restore_alone(client: Any, image: str) -> dict[str, float]:
    """A restore through this path in this process: created (the restore begun), first
    output of the restored runtime (it answers an empty request with an error), runsc's
    exit, everything removed."""
    run_id = f"bench-{os.getpid()}"
    spec = SandboxSpec(
        run_id,
        image,
        ("python", "-m", "orchestrator_runtime"),
        Limits(),
        NetworkPolicy(mode="none"),
        labels=run_labels(run_id),
        runtime=direct.RUNSC_DIRECT,
    )
    started = time.perf_counter()
    sandbox = direct.create(client, spec, lambda _: None)
    created = time.perf_counter() - started
    try:
        sandbox.write(b"", close=True)
        first = None
        for _ in sandbox.stream():
            first = first or time.perf_counter() - started
        exited = sandbox.wait(30)
        if exited.exit_code != 2 or first is None:  # the runtime's answer to no request
            raise SystemExit(f"the restored runtime went wrong: {exited}")
        ended = time.perf_counter() - started
    finally:
        sandbox.remove()
    return {
        "total": time.perf_counter() - started,
        "create": created,
        "first output": first,
        "exit": ended,
    }


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--network",
        choices=("none", "allowlist"),
        default="none",
        help="none (default): the runs a snapshot serves; allowlist: a networked run (its "
        "egress proxy; on runsc-direct a holder container, started cold), written to "
        "runsc_direct_allowlist.json/.md",
    )
    args = parser.parse_args()
    if shutil.which("runsc") is None or os.geteuid() != 0:
        raise SystemExit("needs runsc on PATH (setup-gvisor.sh) and root (the sandbox's cgroup)")
    workdir = Path(tempfile.mkdtemp(prefix="runsc-direct-bench-"))
    try:
        measure(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure(args: argparse.Namespace, workdir: Path) -> None:
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        os.environ.pop(name, None)
    for package in ("orchestrator", "orchestrator_runtime"):
        compileall.compile_dir(REPO / package, quiet=1)
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    engine_snapshots = bool(client.api.info().get("ExperimentalBuild"))
    engine = "snapshot" if engine_snapshots else "cold"
    if args.network == "allowlist":  # no snapshot serves a networked run on any path
        net = ("--network", "allowlist", "--allow-host", "example.com")
        sides: dict[str, Callable[[], dict[str, float]]] = {
            "docker run (runc)": lambda: docker_run(image, "runc"),
            "orchestrator run (runc, allowlist)": lambda: orchestrator_run(
                image, "runc", options=net
            ),
            "orchestrator run (runsc via the engine, allowlist, cold)": lambda: orchestrator_run(
                image, "runsc", snapshot=False, options=net
            ),
            "orchestrator run (runsc-direct, allowlist, held, cold)": lambda: orchestrator_run(
                image, direct.RUNSC_DIRECT, snapshot=False, options=net
            ),
        }
    else:
        # What a user gets by default: `auto`, runsc-direct on a host that can run it (as
        # root, with runsc installed: what this benchmark needs anyway).
        auto = DockerBackend(client).runtime_for("auto")
        if auto != direct.RUNSC_DIRECT:
            raise SystemExit(f"`auto` is {auto} here, not {direct.RUNSC_DIRECT}")
        orchestrator_run(image, None, snapshot=True)  # the payload's hint, for the head start
        sides = {
            "docker run (runc)": lambda: docker_run(image, "runc"),
            "orchestrator run (runc)": lambda: orchestrator_run(image, "runc"),
            f"orchestrator run (runsc via the engine, {engine})": lambda: orchestrator_run(
                image, "runsc", snapshot=engine_snapshots
            ),
            "orchestrator run (default: auto = runsc-direct, restored, head start)": (
                lambda: orchestrator_run(image, None, snapshot=True, head_start=True)
            ),
            "orchestrator run (auto = runsc-direct, restored, head start off)": (
                lambda: orchestrator_run(image, None, snapshot=True, head_start=False)
            ),
            "runsc-direct restore alone (in-process)": lambda: restore_alone(client, image),
        }
    for side in sides.values():
        side()  # the image exported, the snapshots made, the page cache warm for every side
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    loads = {"before": context.load()}
    names = list(sides)
    for i in range(args.rounds):  # interleaved, the order turning
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            figures[name].append(sides[name]())
        print(
            f"round {i + 1}: "
            + ", ".join(f"{name} {figures[name][-1]['total']:.2f}s" for name in names),
            file=sys.stderr,
        )
    loads["after"] = context.load()
    floors = [f["total"] for f in figures["docker run (runc)"]]
    rows = {}
    for name, runs in figures.items():
        row = {key: median([run[key] for run in runs]) for key in runs[0]}
        row["x floor"] = round(row["total"] / median(floors), 3)
        row["x floor per round"] = median(
            [r["total"] / f for r, f in zip(runs, floors, strict=True)]
        )
        rows[name] = row
    report = {
        "what": "trivial CodeAgent (batch_math mul: one scripted step, mock model), same image "
        "everywhere; the floor is a bare runc `docker run --rm <image> python -c <agent>`",
        "image": image,
        **context.header(client),
        "experimental": engine_snapshots,
        "rounds": args.rounds,
        "load_1m": loads,
        "medians_seconds": rows,
    }
    if args.network != "none":
        report["what"] += f"; every orchestrator run on network {args.network}"
    stem = "runsc_direct" if args.network == "none" else f"runsc_direct_{args.network}"
    if report["storage"] != "overlay2":  # what most hosts have: the plain name
        stem += f"_{report['storage']}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# runsc-direct against the floor",
        "",
        f"{context.summary(report)}; the engine's experimental mode "
        f"{'on' if report.get('experimental') else 'off'}; load (1 min) "
        f"{report['load_1m']['before']} before, {report['load_1m']['after']} after; "
        f"{report['rounds']} interleaved rounds, medians.",
        "",
        report["what"] + ".",
        "",
        "| side | total s | x floor | x floor per round | phases (s) |",
        "|---|---|---|---|---|",
    ]
    for name, row in report["medians_seconds"].items():
        phases = ", ".join(
            f"{k} {v}" for k, v in row.items() if k not in ("total", "x floor", "x floor per round")
        )
        lines.append(
            f"| {name} | {row['total']} | {row['x floor']} | {row['x floor per round']} | "
            f"{phases} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
