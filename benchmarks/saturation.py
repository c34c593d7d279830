"""Throughput at saturation (issue 28): warm against cold (`--no-warm`) at fixed concurrency 1,
4, 8 and 32 (`--fixed-concurrency`), at `auto` (the default: adapts to the host) and at a
requested 32 (a ceiling: it adapts under it), for 64 and 300 mock tasks, side by side in one
run; plus the host's memory during each batch.

Each configuration runs warm and cold back to back, the side that goes first alternating,
with a pause between measurements; the load average and the running containers are
recorded before each one, and for adaptive runs the limit's range and changes. Results are
written after every measurement (a run cut short keeps what it measured).

    python benchmarks/saturation.py [--tasks 64 300] [--configs auto 32 fixed4 fixed8 ...]
                                    [--rounds 4 2] [--runtime auto|runc|runsc] [--name saturation]

`fixed32` is exactly 32 at once (`--fixed-concurrency`), `32` is a requested 32 (a
ceiling), `auto` is the default. Rounds go round-major (every configuration once, then
again) and come in mirrored pairs: the second round of a pair runs the first one's batches
in exactly the reverse order (configurations and sides), so every configuration's two
batches lie as far before as after the pair's middle, and a machine whose speed drifts
steadily over the pair (on 2026-11-26 the same task cost this machine's host 0.95-1.27 s of
CPU from batch to batch) slows or speeds every configuration alike. Each pair starts one
configuration further on (none always follows the same one). The verdicts compare rates
pooled over the rounds (all tasks over all wall time), and per pair, so the pairs show how
far a comparison moves from pair to pair. Besides throughput, each batch records the host's
CPU seconds per task (busy jiffies of /proc/stat over the batch) and the share of the CPU
the hypervisor took (steal). Writes benchmarks/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402
from batch_throughput import PAYLOAD, SameImageBackend, running, tasks  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.batch import BatchSpec, run_batch  # noqa: E402
from orchestrator.execution.hostload import PROC_MEMINFO, PROC_STAT, cpu_times, memory_mb  # noqa: E402
from orchestrator.labels import LABEL_OWNER, owner_label  # noqa: E402
from orchestrator.spec import RunSpec  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
OWNER = owner_label()


def used_mb() -> int:
    available, total = memory_mb(PROC_MEMINFO.read_text())
    return (total or 0) - (available or 0)


def containers_rss_mb(client) -> int:  # a docker client
    """The resident memory of this process's containers (sandboxes idle or running): the sum
    of their cgroups' total_rss (cgroup v1, as on these machines; 0 where unreadable)."""
    total = 0
    owned = client.api.containers(quiet=True, filters={"label": f"{LABEL_OWNER}={OWNER}"})
    for container in owned:
        stat = Path(f"/sys/fs/cgroup/memory/docker/{container['Id']}/memory.stat")
        try:
            for line in stat.read_text().splitlines():
                if line.startswith("total_rss "):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total // 2**20


class MemoryWatch:
    """Memory during a batch, sampled every 0.5 s: the resident memory of its containers
    (what the sandboxes hold; other work on the host does not count) and the host's used
    memory (total - available) above what it was before (other work counts)."""

    def __init__(self, client) -> None:  # a docker client
        self.client = client
        self.base = used_mb()
        self.host: list[int] = []
        self.ours: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.host.append(used_mb())
            self.ours.append(containers_rss_mb(self.client))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        host, ours = self.host or [self.base], self.ours or [0]
        return {
            "containers_peak_mb": max(ours),
            "containers_mean_mb": round(sum(ours) / len(ours)),
            "host_before_mb": self.base,
            "host_peak_above_mb": max(host) - self.base,
        }


class CountingBackend(SameImageBackend):
    """Counts the sandboxes made cold (`create`, in a run's slot) and warm (`create_idle`, by
    the pool's builders): a warm batch whose runs go cold beside the builders shows here."""

    def __init__(self, client, image: str) -> None:  # a docker client
        super().__init__(client, image)
        self.made = {"cold": 0, "warm": 0}
        self._lock = threading.Lock()

    def create(self, spec, progress):
        with self._lock:
            self.made["cold"] += 1
        return super().create(spec, progress)

    def create_idle(self, spec, progress, ttl):
        with self._lock:
            self.made["warm"] += 1
        return super().create_idle(spec, progress, ttl)


#: The engine's long-lived daemons: their CPU over a batch is measured apart from the
#: sandboxes' (each container's shim and runtime live only as long as it does).
ENGINE_DAEMONS = ("dockerd", "containerd")


def engine_cpu_seconds() -> float:
    """The CPU seconds the engine's daemons have used so far (user + system, /proc)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
        if name in ENGINE_DAEMONS:
            fields = rest.split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def steal_jiffies(text: str) -> int:
    """All cores' steal time so far, from /proc/stat's `text` (its 8th column): CPU the
    hypervisor gave to other machines while this one had work."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            values = line.split()[1:]
            return int(values[7]) if len(values) > 7 else 0
    return 0


def own_cpu_seconds() -> float:
    """The CPU seconds of this process (the batch runs in it: scheduler, pool, builders)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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


def one_batch(
    n: int,
    config: str,
    warm: bool,
    workdir: Path,
    backend: SameImageBackend,
    runtime: str | None = None,
) -> dict:
    backend = CountingBackend(backend.client, backend.image)  # this batch's counts only
    path = workdir / "tasks.jsonl"
    with open(path, "w") as file:
        for i, (a, b) in enumerate(tasks(n)):
            row = {
                "id": f"t{i}",
                "task": "What is a * b?",
                "expected": a * b,
                "additional_args": {"op": "mul", "a": a, "b": b},
            }
            file.write(json.dumps(row) + "\n")
    concurrency, adapt = config_spec(config)
    spec = BatchSpec(
        tasks=path,
        output=workdir / "out",
        run=RunSpec(payload=PAYLOAD, sandbox_runtime=runtime),
        concurrency=concurrency,
        adapt=adapt,
        warm=None if warm else 0,
    )
    memory = MemoryWatch(backend.client)
    stat = PROC_STAT.read_text()
    (busy_before, total_before), steal_before = cpu_times(stat), steal_jiffies(stat)
    own_before, engine_before = own_cpu_seconds(), engine_cpu_seconds()
    started = time.monotonic()
    summary = run_batch(spec, backend=backend)
    wall = time.monotonic() - started
    stat = PROC_STAT.read_text()
    (busy, total), steal = cpu_times(stat), steal_jiffies(stat) - steal_before
    own, engine = own_cpu_seconds() - own_before, engine_cpu_seconds() - engine_before
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    pace = summary.concurrency
    return {
        "wall_seconds": round(wall, 2),
        "tasks_per_minute": round(n / wall * 60, 1),
        "cpu_seconds_per_task": round((busy - busy_before) / ticks_per_second / n, 3),
        "cpu_busy_share": round((busy - busy_before) / max(1, total - total_before), 3),
        # Of the host's time, the share the hypervisor gave to other machines (counted busy).
        "steal_share": round(steal / max(1, total - total_before), 3),
        # Of that: this process's (the orchestrator) and the engine's daemons'; the rest is
        # the sandboxes' (with their shims and runtimes) and whatever else the host ran.
        "orchestrator_cpu_per_task": round(own / n, 3),
        "engine_cpu_per_task": round(engine / n, 3),
        "correct": int(summary.correct),
        "counts": {k: v for k, v in summary.counts.items() if v},
        "duration_p50": summary.duration_p50,
        "sandboxes_made": backend.made,
        "memory": memory.stop(),
        "concurrency": {k: pace[k] for k in ("mode", "ceiling", "limit", "lowest", "highest")},
        "changes": pace["changes"],
    }


def pooled(rows: list[dict]) -> dict[tuple[int, str], dict[str, float]]:
    """Per (tasks, config), over `rows` with both sides: each side's rate pooled (all its tasks
    over all its wall time), its median CPU seconds per task (and the orchestrator's and the
    engine daemons' parts), and how many rounds."""
    found: dict[tuple[int, str], dict[str, list[float]]] = {}
    for row in rows:
        w, c = row.get("warm"), row.get("cold")
        if not (w and c):
            continue
        seen = found.setdefault((row["tasks"], row["config"]), {})
        seen.setdefault("tasks", []).append(row["tasks"])
        for name, side in (("warm", w), ("cold", c)):
            seen.setdefault(f"{name}_wall", []).append(side["wall_seconds"])
            seen.setdefault(f"{name}_cpu", []).append(side.get("cpu_seconds_per_task", 0.0))
            for part in ("orchestrator", "engine"):
                got = side.get(f"{part}_cpu_per_task")
                if got is not None:  # results from before the split have none
                    seen.setdefault(f"{name}_{part}", []).append(got)
    table: dict[tuple[int, str], dict[str, float]] = {}
    for key, seen in found.items():
        m: dict[str, float] = {"rounds": len(seen["tasks"])}
        for name in ("warm", "cold"):
            m[name] = 60 * sum(seen["tasks"]) / sum(seen[f"{name}_wall"])
        for k, v in seen.items():
            if k.endswith(("_cpu", "_orchestrator", "_engine")):
                m[k] = statistics.median(v)
        table[key] = m
    return table


def pairs(report: dict) -> dict[int, list[list[dict]]]:
    """Per task count: its rounds' rows, grouped by mirrored pair (in order)."""
    found: dict[int, dict[int, list[dict]]] = {}
    for row in report["results"]:
        pair = row.get("pair", (row["round"] + 1) // 2)
        found.setdefault(row["tasks"], {}).setdefault(pair, []).append(row)
    return {n: [rows for _, rows in sorted(by.items())] for n, by in found.items()}


def best_fixed(table: dict[tuple[int, str], dict[str, float]], n: int) -> tuple[float, str]:
    """The best fixed concurrency for `n` tasks: (tasks/min, which: its label and side)."""
    best = (0.0, "")
    for (size, config), m in table.items():
        if size == n and config.startswith("fixed"):
            for side in ("warm", "cold"):
                if m[side] > best[0]:
                    best = (m[side], f"{label(config)}, {side}")
    return best


def spread(report: dict) -> dict[int, list[float]]:
    """Per task count: for each configuration and side measured in two rounds or more, how
    far its rounds lie apart ((max - min) / median of tasks/min)."""
    rates: dict[tuple[int, str, str], list[float]] = {}
    for row in report["results"]:
        for side in ("warm", "cold"):
            if row.get(side):
                key = (row["tasks"], row["config"], side)
                rates.setdefault(key, []).append(row[side]["tasks_per_minute"])
    found: dict[int, list[float]] = {}
    for (n, _config, _side), seen in rates.items():
        if len(seen) >= 2:
            found.setdefault(n, []).append((max(seen) - min(seen)) / statistics.median(seen))
    return found


def span(values: list[float]) -> str:
    """`0.97` for one value, `0.95-1.02` for several (lowest-highest)."""
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:.2f}" if len(values) == 1 else f"{low:.2f}-{high:.2f}"


def verdicts(report: dict) -> list[str]:
    """The issue's three comparisons, pooled over every round and per mirrored pair: warm
    against cold in each row; auto and a requested 32 against the best fixed concurrency (the
    better side of its best row)."""
    table = pooled(report["results"])
    by_pair = {n: [pooled(rows) for rows in groups] for n, groups in pairs(report).items()}
    lines = [
        "| tasks | concurrency | rounds | warm tasks/min | cold tasks/min | warm / cold "
        "| warm / cold, each pair | CPU s per task, warm / cold "
        "| of which orchestrator; engine daemons |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (n, config), m in table.items():
        split = (
            "; ".join(
                f"{m[f'warm_{part}']:.3f} / {m[f'cold_{part}']:.3f}"
                for part in ("orchestrator", "engine")
                if f"warm_{part}" in m and f"cold_{part}" in m
            )
            or "-"
        )
        each = [t[(n, config)] for t in by_pair.get(n, []) if (n, config) in t]
        lines.append(
            f"| {n} | {label(config)} | {m['rounds']:.0f} | {m['warm']:.1f} | {m['cold']:.1f} "
            f"| {m['warm'] / m['cold']:.2f} | {span([e['warm'] / e['cold'] for e in each])} "
            f"| {m['warm_cpu']:.3f} / {m['cold_cpu']:.3f} | {split} |"
        )
    spreads = spread(report)
    if spreads:
        lines += [
            "",
            "Run-to-run spread (a configuration's rounds, one side: (max - min) / median): "
            + "; ".join(
                f"{n} tasks median {statistics.median(s):.1%}, at most {max(s):.1%}"
                for n, s in sorted(spreads.items())
            ),
        ]
    sizes = sorted({n for n, _ in table})
    if any(best_fixed(table, n)[0] for n in sizes):
        lines += [
            "",
            "Adaptive against the best fixed concurrency of the same size (pooled; then the same "
            "ratio within each mirrored pair, against that pair's best fixed):",
            "",
        ]
    for n in sizes:
        rate, which = best_fixed(table, n)
        if not rate:
            continue
        for (size, config), m in table.items():
            if size != n or config.startswith("fixed"):
                continue
            per_pair: dict[str, list[float]] = {"warm": [], "cold": []}
            for t in by_pair.get(n, []):
                pair_best = best_fixed(t, n)[0]
                if (n, config) in t and pair_best:
                    for side in per_pair:
                        per_pair[side].append(t[(n, config)][side] / pair_best)
            lines.append(
                f"- {n} tasks, {label(config)}: warm {m['warm'] / rate:.2f} "
                f"(pairs {span(per_pair['warm'])}), cold {m['cold'] / rate:.2f} "
                f"(pairs {span(per_pair['cold'])}) of {rate:.1f} tasks/min ({which})"
            )
    return lines


def save(name: str, report: dict, lines: list[str]) -> None:
    """The report as benchmarks/results/<name>.json, and its Markdown `lines` as .md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


def write(report: dict) -> None:
    lines = [
        "# Throughput at saturation: warm against cold, fixed against adaptive concurrency",
        "",
        f"{report['what']}; {context.summary(report, started=True)}; sandbox runtime "
        f"{report.get('runtime', 'auto')}. Warm = the default pool; cold = `--no-warm`. Each "
        "configuration ran warm and cold back to back (the first side alternating), with a "
        "pause between; rounds went round-major in mirrored pairs (the second round of a pair "
        "ran the first's batches backwards). Rates are pooled: all tasks over all wall time. "
        "CPU s per task: the host's busy CPU seconds over the batch per task; of which the "
        "orchestrator's own process and the engine's daemons (dockerd, "
        "containerd); the rest is the sandboxes' (shims and runtimes included).",
        "",
        "## Pooled over the rounds",
        "",
        *verdicts(report),
        "",
        "## Every batch",
        "",
        "`load` is the 1-minute load average before each (warm/cold); memory is the resident "
        "memory of the batch's containers, peak and mean (idle sandboxes included); steal is "
        "the share of the host's CPU time the hypervisor gave to other machines.",
        "",
        "| tasks | concurrency | round | warm tasks/min | cold tasks/min | warm / cold "
        "| at once (warm; cold) | containers' memory MB, peak (mean): warm / cold "
        "| load before | steal, warm / cold |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        w, c = row.get("warm"), row.get("cold")
        if not (w and c):
            continue
        at_once = "; ".join(
            f"{s['concurrency']['lowest']}-{s['concurrency']['highest']}"
            if s["concurrency"]["mode"] == "auto"
            else str(s["concurrency"]["limit"])
            for s in (w, c)
        )
        lines.append(
            f"| {row['tasks']} | {label(row['config'])} | {row['round']} "
            f"| {w['tasks_per_minute']:.1f} | {c['tasks_per_minute']:.1f} "
            f"| {w['tasks_per_minute'] / c['tasks_per_minute']:.2f} "
            f"| {at_once} | {mem(w)} / {mem(c)} "
            f"| {w['before']['load_1m']} / {c['before']['load_1m']} "
            f"| {w.get('steal_share', '-')} / {c.get('steal_share', '-')} |"
        )
    lines += [
        "",
        f"Uptime before and after: {report.get('uptime_before')} / "
        f"{report.get('uptime_after', 'not finished')}",
    ]
    save(report.get("name", "saturation"), report, lines)


def mem(side: dict) -> str:
    return f"{side['memory']['containers_peak_mb']} ({side['memory']['containers_mean_mb']})"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def setup() -> tuple[Path, SameImageBackend, str]:
    """A private store in a temporary directory, the agent image, and the commit measured
    (the reports take theirs from context.header; the wrappers quoted in
    results/warm_*.md use this one)."""
    workdir = Path(tempfile.mkdtemp(prefix="saturation-bench-"))
    os.environ["ORCHESTRATOR_HOME"] = str(workdir / "home")  # a private store
    os.environ.setdefault(
        "ORCHESTRATOR_WHEELHOUSE", str(Path.home() / ".orchestrator" / "wheelhouse")
    )
    client = connect()
    image = ensure_agent_image(client, progress=lambda m: print(m, file=sys.stderr))
    return workdir, SameImageBackend(client, image), context.commit()


def teardown(workdir: Path, client) -> None:  # a docker client
    """Nothing of the benchmark's left behind, also when it was interrupted: its directory
    and any container of this process's."""
    shutil.rmtree(workdir, ignore_errors=True)
    for container in client.api.containers(
        all=True, quiet=True, filters={"label": f"{LABEL_OWNER}={OWNER}"}
    ):
        with contextlib.suppress(Exception):
            client.api.remove_container(container["Id"], force=True)


def measure(args: argparse.Namespace, report: dict, workdir: Path, backend) -> None:
    """Every configuration's batches, warm and cold, round-major in mirrored pairs
    (`round_steps`); the report written after each batch."""
    client = backend.client
    (workdir / "warmup").mkdir()
    runtime = None if args.runtime == "auto" else args.runtime
    one_batch(4, "fixed2", True, workdir / "warmup", backend, runtime)  # caches, image layers
    for i, n in enumerate(args.tasks):
        for r in range(args.rounds[min(i, len(args.rounds) - 1)]):
            rows: dict[str, dict] = {}
            for config, side in round_steps(args.configs, r):
                if config not in rows:
                    rows[config] = {
                        "tasks": n,
                        "config": config,
                        "round": r + 1,
                        "pair": r // 2 + 1,
                    }
                    report["results"].append(rows[config])
                row = rows[config]
                time.sleep(args.pause)
                out = workdir / f"{n}-{config}-{r}-{side}"
                out.mkdir()
                before = {
                    "load_1m": context.load(),
                    "containers": running(client),
                    "uptime": uptime(),
                }
                row[side] = one_batch(n, config, side == "warm", out, backend, runtime)
                row[side]["before"] = before
                write(report)
                if "warm" in row and "cold" in row:
                    w, c = row["warm"], row["cold"]
                    print(
                        f"{n} tasks, {label(config)}, round {r + 1}: warm "
                        f"{w['tasks_per_minute']}/min "
                        f"(at once {w['concurrency']['lowest']}-{w['concurrency']['highest']}, "
                        f"mem {mem(w)} MB), cold {c['tasks_per_minute']}/min "
                        f"(at once {c['concurrency']['lowest']}-{c['concurrency']['highest']}, "
                        f"mem {mem(c)} MB); load "
                        f"{w['before']['load_1m']}/{c['before']['load_1m']}",
                        flush=True,
                    )


def round_steps(configs: list[str], r: int) -> list[tuple[str, str]]:
    """Round `r`'s batches, (config, side), in order. Round 2k runs the configurations from
    the k-th on (none always right after the same one: a machine whose speed depends on how
    busy it just was would give that place's effect to one configuration in every round),
    each warm and cold back to back, the first side alternating; round 2k+1 runs exactly
    those batches backwards, so over the pair every batch's mean time is the pair's middle."""
    shift = (r // 2) % len(configs)
    steps: list[tuple[str, str]] = []
    for config in configs[shift:] + configs[:shift]:
        index = configs.index(config)
        sides = ("warm", "cold") if (index + r // 2) % 2 == 0 else ("cold", "warm")
        steps += [(config, side) for side in sides]
    return steps if r % 2 == 0 else steps[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[64, 300])
    parser.add_argument(
        "--configs", nargs="+", default=["auto", "32", "fixed4", "fixed8", "fixed32", "fixed1"]
    )
    parser.add_argument(
        "--rounds",
        type=int,
        nargs="+",
        default=[4, 2],
        help="rounds for each --tasks size, in order (the last one for the rest); even "
        "numbers, so that every round has its mirror",
    )
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between batches")
    parser.add_argument(
        "--runtime",
        choices=["auto", "runc", "runsc"],
        default="auto",
        help="the sandboxes' runtime (auto: gVisor where the engine has it, as a user gets)",
    )
    parser.add_argument("--name", default="saturation", help="results file name")
    args = parser.parse_args()

    workdir, backend, _ = setup()
    client = backend.client
    report: dict = {
        "what": "mock tasks (batch_math, one CodeAgent step each)",
        "image": backend.image,
        **context.header(client),
        "name": args.name,
        "runtime": args.runtime,
        "uptime_before": uptime(),
        "results": [],
    }
    try:
        measure(args, report, workdir, backend)
    finally:
        teardown(workdir, client)
    report["uptime_after"] = uptime()
    write(report)
    print((RESULTS / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
