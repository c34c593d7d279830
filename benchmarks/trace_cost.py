"""What tracing costs a run: the warm path (and the cold command) with tracing on vs off, side
by side in one run (issue 25).

Each round runs the same payload warm (`Pool.run` with a ready sandbox) twice, interleaved:
once without tracing, once exporting its trace (`traces_to`) to a real OTLP/HTTP endpoint on
this host (tests/otlp_receiver.py: decodes every request with OpenTelemetry's protobuf
classes), each from a pool of its own (a traced sandbox's runtime imports the
instrumentation while it idles: `--preload traces`). Two payloads: `batch_math` (one agent,
one step: the smallest trace) and `research_team` (a manager and a managed agent: 15 spans).
Then the cold command (`orchestrator run`, a process) on vs off, which adds the host's import
of OpenTelemetry and the runtime's instrumentation on a cold sandbox.

Run by hand (not a test; ~5 minutes on 2 cores):

    python benchmarks/trace_cost.py [--rounds 9]

Writes benchmarks/results/trace_cost.json and .md; the load average is recorded.
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402
from batch_throughput import SameImageBackend  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.execution.pool import Pool  # noqa: E402
from orchestrator.lifecycle.runner import prepare  # noqa: E402
from orchestrator.spec import RunSpec  # noqa: E402
from tests.otlp_receiver import OtlpReceiver  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PAYLOADS = {
    "batch_math": RunSpec(
        payload=REPO / "tests" / "payloads" / "batch_math",
        task="mul",
        additional_args={"op": "mul", "a": 6, "b": 7},
    ),
    "research_team": RunSpec(payload=REPO / "agent_payloads" / "research_team"),
}


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def warm_run(pool: Pool, spec: RunSpec) -> tuple[float, dict[str, Any]]:
    while pool.stats()["idle"] < pool.size:
        time.sleep(0.05)
    started = time.perf_counter()
    result = pool.run(spec)
    took = time.perf_counter() - started
    if result.status != "succeeded" or not result.warm:
        raise SystemExit(f"warm run went wrong: {result.status} {result.error} {result.warm}")
    if spec.traces_to not in (None, "off") and not result.traces.get("exported"):
        raise SystemExit(f"trace not exported: {result.traces}")
    return took, result.traces


def cold_cli(payload: str, *extra: str) -> float:
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", payload, "--json", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    took = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"cold run failed: {out.stderr[-2000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="trace-bench-"))
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        os.environ.pop(name, None)
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    backend = SameImageBackend(client, image)

    rows = []
    with OtlpReceiver() as receiver:
        loads = {"warm": context.load()}
        for name, base in PAYLOADS.items():
            specs = {"off": base, "on": RunSpec(**{**vars(base), "traces_to": receiver.url})}
            times: dict[str, list[float]] = {"off": [], "on": []}
            spans = []
            with Pool(size=1, backend=backend) as off, Pool(size=1, backend=backend) as on:
                pools = {"off": off, "on": on}
                for side in ("off", "on"):
                    pools[side].keep_ready(prepare(specs[side]))
                    warm_run(pools[side], specs[side])  # first runs: page cache, imports
                for i in range(args.rounds):  # interleaved: a drift in load favours no side
                    for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                        took, traces = warm_run(pools[side], specs[side])
                        times[side].append(took)
                        if side == "on":
                            spans.append(traces["spans"])
                    print(
                        f"{name} round {i + 1}: off {times['off'][-1]:.3f}s, "
                        f"on {times['on'][-1]:.3f}s",
                        file=sys.stderr,
                    )
            rows.append(
                {
                    "path": f"warm {name}",
                    "off": median(times["off"]),
                    "on": median(times["on"]),
                    "cost": round(median(times["on"]) - median(times["off"]), 3),
                    "spans": max(spans),
                    "off_all": times["off"],
                    "on_all": times["on"],
                }
            )
        loads["cold"] = context.load()
        payload = str(PAYLOADS["research_team"].payload)
        cold_cli(payload)
        cold: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(args.rounds):
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                extra = ("--traces-to", receiver.url) if side == "on" else ()
                cold[side].append(cold_cli(payload, *extra))
            print(
                f"cold round {i + 1}: off {cold['off'][-1]:.3f}s, on {cold['on'][-1]:.3f}s",
                file=sys.stderr,
            )
        rows.append(
            {
                "path": "cold `orchestrator run` research_team",
                "off": median(cold["off"]),
                "on": median(cold["on"]),
                "cost": round(median(cold["on"]) - median(cold["off"]), 3),
                "spans": None,
                "off_all": cold["off"],
                "on_all": cold["on"],
            }
        )
        received = len(receiver.spans)

    report = {
        "what": "tracing on (exported to a local OTLP/HTTP endpoint) vs off, same image",
        "image": image,
        **context.header(client),
        "rounds": args.rounds,
        "load_average": loads,
        "spans_received": received,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "trace_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# What tracing costs a run",
        "",
        f"{report['what']}; {context.summary(report)}; {args.rounds} rounds, interleaved, medians; "
        f"load average {loads}.",
        "",
        "| path | off (s) | on (s) | cost per run (s) | spans per run |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['path']} | {row['off']} | {row['on']} | {row['cost']} | "
            f"{row['spans'] if row['spans'] is not None else '-'} |"
        )
    (RESULTS / "trace_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
