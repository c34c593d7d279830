"""Warm sandboxes and the cold path against the floor, side by side in one run (issue 14).

The same image and the same trivial agent (one CodeAgent step, scripted model) everywhere:

- `docker run`: bare `docker run --rm <image> python -c <agent script>` (the DESIGN's floor);
- `session`: llm-sandbox's session pattern with init (the SDK starts a container running
  `tail -f /dev/null` under `--init`, copies the script in, execs it, kills and removes it);
- `cold run`: the `orchestrator run` command (hardened sandbox, run record), as a process;
- `warm run`: `Pool.run` with a ready sandbox (the Python API): end to end, and submit ->
  runtime running (the sandbox's first event, `run_start`, seen by the host);
- a hosted model: the same agent with `openai:scripted` through the model gateway, against
  the scripted OpenAI-compatible server of the tests on the host; cold and warm, through the
  Python API (a warm sandbox has imported openai while it idled: `--preload`);
- batch of N tasks at concurrency 1 and 4: bare `docker run` vs `orchestrator batch` (warm
  by default when the batch is longer than its concurrency).

Run by hand (not a test; ~10 minutes on 2 cores):

    python benchmarks/warm_pool.py [--rounds 7] [--tasks 100]

Writes benchmarks/results/warm_pool.json and .md; the load average before each part is
recorded, so a busy machine shows in the figures.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402
from batch_throughput import AGENT_SCRIPT, SameImageBackend, tasks  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.batch import BatchSpec, run_batch  # noqa: E402
from orchestrator.execution.pool import Pool  # noqa: E402
from orchestrator.lifecycle.runner import prepare, run  # noqa: E402
from orchestrator.payloads.manifest import load_manifest  # noqa: E402
from orchestrator.spec import RunSpec  # noqa: E402
from tests.model_server import ScriptedModelServer  # noqa: E402

PAYLOAD = REPO / "tests" / "payloads" / "batch_math"
RESULTS = REPO / "benchmarks" / "results"
ARGS = {"op": "mul", "a": 6, "b": 7}
#: A pause before each batch, so that neither side pays for the previous part's removals.
SETTLE_SECONDS = 15


def docker_run(image: str, a: int = 6, b: int = 7) -> bool:
    out = subprocess.run(
        ["docker", "run", "--rm", image, "python", "-c", AGENT_SCRIPT, str(a), str(b)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.returncode == 0 and out.stdout.strip().splitlines()[-1] == str(a * b)


def session_pattern(client, image: str) -> bool:  # a docker client
    """llm-sandbox's SandboxSession (docker backend) with init, through the SDK as it does."""
    api = client.api
    container = api.create_container(
        image, ["tail", "-f", "/dev/null"], host_config=api.create_host_config(init=True)
    )
    try:
        api.start(container)
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w") as tar:
            script = AGENT_SCRIPT.encode()
            info = tarfile.TarInfo("agent.py")
            info.size = len(script)
            tar.addfile(info, io.BytesIO(script))
        api.put_archive(container, "/tmp", data.getvalue())
        exec_id = api.exec_create(container, ["python", "/tmp/agent.py", "6", "7"])
        output = api.exec_start(exec_id).decode()
        return output.strip().splitlines()[-1] == "42"
    finally:
        api.kill(container)
        api.remove_container(container, force=True)


def cold_cli() -> bool:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "run",
            str(PAYLOAD),
            "mul",
            "--arg",
            'op="mul"',
            "--arg",
            "a=6",
            "--arg",
            "b=7",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    return out.returncode == 0 and json.loads(out.stdout)["answer"] == 42


def timed(fn) -> float:
    started = time.perf_counter()
    ok = fn()
    took = time.perf_counter() - started
    if not ok:
        raise SystemExit(f"{fn} did not give the right answer")
    return took


def warm_runs(pool: Pool, rounds: int) -> tuple[list[float], list[float]]:
    """End to end and submit -> runtime running, each with a ready sandbox."""
    ends, starts = [], []
    pool.keep_ready(prepare(RunSpec(payload=PAYLOAD, task="mul", additional_args=ARGS)))
    for _ in range(rounds):
        while pool.stats()["idle"] < pool.size:
            time.sleep(0.05)
        first: dict[str, float] = {}

        def seen(event: dict, first: dict[str, float] = first) -> None:
            if event.get("type") == "run_start" and "t" not in first:
                first["t"] = time.perf_counter()

        started = time.perf_counter()
        result = pool.run(RunSpec(payload=PAYLOAD, task="mul", additional_args=ARGS), on_event=seen)
        ends.append(time.perf_counter() - started)
        if result.status != "succeeded" or result.answer != 42 or not result.warm:
            raise SystemExit(f"warm run went wrong: {result.status} {result.error}")
        starts.append(first["t"] - started)
    return ends, starts


def hosted_runs(backend, rounds: int) -> tuple[list[float], list[float]]:
    """End to end with `openai:scripted` through the model gateway: cold runs, then warm."""
    answer = load_manifest(PAYLOAD).mock_scripts["manager"][0]
    os.environ.setdefault("OPENAI_API_KEY", "sk-benchmark")
    with ScriptedModelServer([answer] * (2 * rounds + 1)) as server:
        spec = RunSpec(
            payload=PAYLOAD,
            task="mul",
            additional_args=ARGS,
            model="openai:scripted",
            api_base=server.api_base(),
        )

        def check(result) -> None:
            if result.status != "succeeded" or result.answer != 42:
                raise SystemExit(f"hosted run went wrong: {result.status} {result.error}")

        cold = []
        for _ in range(rounds):
            started = time.perf_counter()
            check(run(spec, backend=backend))
            cold.append(time.perf_counter() - started)
        warm = []
        with Pool(size=1, backend=backend) as pool:
            pool.keep_ready(prepare(spec))
            for _ in range(rounds):
                while pool.stats()["idle"] < pool.size:
                    time.sleep(0.05)
                started = time.perf_counter()
                result = pool.run(spec)
                warm.append(time.perf_counter() - started)
                check(result)
                if not result.warm:
                    raise SystemExit("the hosted warm run was cold")
    return cold, warm


def batch_floor(image: str, n: int, concurrency: int) -> float:
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as workers:
        ok = list(workers.map(lambda ab: docker_run(image, *ab), tasks(n)))
    if not all(ok):
        raise SystemExit("docker run batch: wrong answers")
    return n / (time.monotonic() - started) * 60


def batch_ours(n: int, concurrency: int, workdir: Path, backend, warm: int | None) -> float:
    path = workdir / f"tasks-{concurrency}-{warm}.jsonl"
    with open(path, "w") as file:
        for i, (a, b) in enumerate(tasks(n)):
            row = {
                "id": f"t{i}",
                "task": "mul",
                "expected": a * b,
                "additional_args": {"op": "mul", "a": a, "b": b},
            }
            file.write(json.dumps(row) + "\n")
    spec = BatchSpec(
        tasks=path,
        output=workdir / f"out-{concurrency}-{warm}",
        run=RunSpec(payload=PAYLOAD),
        concurrency=concurrency,
        warm=warm,
    )
    started = time.monotonic()
    summary = run_batch(spec, backend=backend)
    if summary.correct != n:
        raise SystemExit(f"batch: {summary.counts}")
    return n / (time.monotonic() - started) * 60


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4])
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="warm-bench-"))
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    backend = SameImageBackend(client, image)
    for fn in (lambda: docker_run(image), lambda: session_pattern(client, image), cold_cli):
        fn()  # warm the page cache and the image layers for every side

    single: dict[str, list[float]] = {"docker run": [], "session": [], "cold run": []}
    loads = {"single": context.load()}
    for i in range(args.rounds):  # interleaved, so a drift in load favours no side
        single["docker run"].append(timed(lambda: docker_run(image)))
        single["session"].append(timed(lambda: session_pattern(client, image)))
        single["cold run"].append(timed(cold_cli))
        print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in single.items()))
    loads["warm"] = context.load()
    with Pool(size=1, backend=backend) as pool:
        ends, starts = warm_runs(pool, args.rounds)
    single["warm run"] = ends
    print(f"warm: end to end {median(ends)}s, submit -> running {median(starts)}s")
    loads["hosted"] = context.load()
    hosted_cold, hosted_warm = hosted_runs(backend, args.rounds)
    single["hosted cold (API)"], single["hosted warm"] = hosted_cold, hosted_warm
    print(f"hosted model: cold {median(hosted_cold)}s, warm {median(hosted_warm)}s")

    batches = []
    for concurrency in args.concurrency:
        time.sleep(SETTLE_SECONDS)  # the engine's cleanup of the previous part is no load here
        before = context.load()
        floor = batch_floor(image, args.tasks, concurrency)
        ours = batch_ours(args.tasks, concurrency, workdir, backend, None)
        batches.append(
            {
                "concurrency": concurrency,
                "docker_run_per_minute": round(floor, 1),
                "batch_per_minute": round(ours, 1),
                "ratio": round(ours / floor, 3),
                "load_before": before,
            }
        )
        print(f"batch at {concurrency}: docker run {floor:.1f}/min, ours {ours:.1f}/min")

    medians = {k: median(v) for k, v in single.items()}
    fastest_peer = min(medians["docker run"], medians["session"])
    report = {
        "what": "trivial CodeAgent (batch_math mul: one scripted step), same image everywhere",
        "image": image,
        **context.header(client),
        "rounds": args.rounds,
        "load_1m": loads,
        "medians_seconds": medians,
        "all_seconds": {k: [round(x, 3) for x in v] for k, v in single.items()},
        "warm_submit_to_running_median": median(starts),
        "warm_submit_to_running_all": [round(x, 3) for x in starts],
        "warm_speedup_vs_cold_run": round(medians["cold run"] / medians["warm run"], 2),
        "cold_run_vs_fastest_peer": round(medians["cold run"] / fastest_peer, 3),
        "hosted_warm_speedup": round(medians["hosted cold (API)"] / medians["hosted warm"], 2),
        "batches": batches,
    }
    checks = {
        "submit -> running <= 100 ms": report["warm_submit_to_running_median"] <= 0.1,
        "warm >= 3x faster than cold": report["warm_speedup_vs_cold_run"] >= 3,
        "cold run <= fastest peer": report["cold_run_vs_fastest_peer"] <= 1.0,
    }
    for row in batches:
        goal = 1.6 if row["concurrency"] == 1 else 0.95
        checks[f"batch at {row['concurrency']} >= {goal}x docker run"] = row["ratio"] >= goal
    report["checks"] = checks
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "warm_pool.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Warm sandboxes and the cold path",
        "",
        f"{report['what']}; {context.summary(report)}; {args.rounds} rounds, medians; load average "
        f"{loads}.",
        "",
        "| path | median (s) |",
        "|---|---|",
        *(f"| {k} | {v:.3f} |" for k, v in medians.items()),
        f"| warm: submit -> runtime running | {report['warm_submit_to_running_median']:.3f} |",
        "",
        "| batch concurrency | docker run (tasks/min) | orchestrator batch (tasks/min) | ratio |",
        "|---|---|---|---|",
        *(
            f"| {r['concurrency']} | {r['docker_run_per_minute']} | {r['batch_per_minute']} "
            f"| {r['ratio']} |"
            for r in batches
        ),
        "",
        *(f"- {'met' if ok else 'NOT met'}: {name}" for name, ok in checks.items()),
        "",
    ]
    (RESULTS / "warm_pool.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
