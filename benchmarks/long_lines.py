"""One endless output line: host time and memory for a sandbox printing a single line of
20, 50 and 200 MiB (no newline until the end), through `orchestrator run` on the real engine.

Measured per size: the wall time of the run, the orchestrator process's peak RSS, and the
run's status; side by side with `docker run` of the same image printing the same line to
/dev/null (the engine's own cost). The host keeps at most 1 MiB of any line
(orchestrator/records/record.py MAX_LINE_BYTES), so memory stays flat and time grows with the bytes.

    python benchmarks/long_lines.py [--sizes 20 50 200]

Writes benchmarks/results/long_lines.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402

PAYLOAD = REPO / "tests" / "payloads" / "adversary"
RESULTS = REPO / "benchmarks" / "results"

#: Reads its child's peak RSS after the run (ru_maxrss of RUSAGE_CHILDREN, in KiB on Linux).
MEASURE = """
import resource, subprocess, sys, time, json
started = time.perf_counter()
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({
    "seconds": round(time.perf_counter() - started, 2),
    "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
    "exit": done.returncode,
    "stdout": done.stdout[-2000:],
}))
"""


def measured(command: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *command], env=env, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 50, 200])
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="orchestrator-bench-")
    env = {**os.environ, "ORCHESTRATOR_HOME": home}
    image = subprocess.run(
        [sys.executable, "-m", "orchestrator", "images", "build"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    rows = []
    for mb in args.sizes:
        run = measured(
            [
                sys.executable,
                "-m",
                "orchestrator",
                "run",
                str(PAYLOAD),
                "--arg",
                f'mode="longline-{mb}"',
                "--timeout",
                "600",
                "--memory",
                "512",
                "--json",
                "-q",
            ],
            {**env, "PYTHONPATH": str(REPO)},
        )
        result = json.loads(run["stdout"]) if run["stdout"].strip().startswith("{") else {}
        floor = measured(
            [
                "docker",
                "run",
                "--rm",
                "--entrypoint",
                "python",
                image,
                "-c",
                f"import sys\nfor _ in range({mb}): sys.stderr.write('y' * 2**20)\nprint()",
            ],
            env,
        )
        rows.append(
            {
                "mib": mb,
                "orchestrator_seconds": run["seconds"],
                "orchestrator_peak_rss_mb": run["peak_rss_mb"],
                "status": result.get("status"),
                "docker_run_seconds": floor["seconds"],
            }
        )
        print(rows[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {**context.header(), "rows": rows}
    (RESULTS / "long_lines.json").write_text(json.dumps(report, indent=2))
    lines = [
        "# One endless line",
        "",
        f"{context.summary(report)}.",
        "",
        "| MiB in one line | orchestrator run | host peak RSS | status | docker run (floor) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mib']} | {r['orchestrator_seconds']} s | {r['orchestrator_peak_rss_mb']} MB "
            f"| {r['status']} | {r['docker_run_seconds']} s |"
        )
    (RESULTS / "long_lines.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
