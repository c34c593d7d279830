"""The egress proxy's start with a long allowlist: how long squid takes to listen, and the
memory it holds, for allowlists of 1 to 20,000 names (exact, and as wildcards), on the real
engine, under the proxy's own limits (half a CPU, 256 MiB).

Each start is what an `allowlist` run makes (`Egress.start`, `start_proxy`, `wait_ready`:
the policy on squid's stdin, the names in files its ACLs read), timed from `start_proxy` to
squid listening on both its ports; the floor is the same start with one name. The allowlist's
maximum (`orchestrator.policy.MAX_HOSTS`) is among the sizes, and so is twice it.

    python benchmarks/egress_hosts.py [--sizes 1 1000 5000 10000 20000] [--repeat 3]

Writes benchmarks/results/egress_hosts.json and .md.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

import context  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.egress import Egress, ensure_egress_image  # noqa: E402
from orchestrator.labels import run_labels  # noqa: E402
from orchestrator.policy import MAX_HOSTS  # noqa: E402
from orchestrator.spec import NetworkPolicy  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def names(count: int, wildcard: bool) -> tuple[str, ...]:
    prefix = "*." if wildcard else ""
    return tuple(f"{prefix}h{i:05d}.example.test" for i in range(count))


def start_once(client, image: str, hosts: tuple[str, ...]) -> dict[str, float]:
    """One proxy started with `hosts` and removed: seconds to listen, memory once listening."""
    run_id = f"bench-egress-{secrets.token_hex(4)}"
    labels = run_labels(run_id)
    egress = Egress.start(client, run_id=run_id, labels=labels)
    try:
        policy = NetworkPolicy(mode="allowlist", hosts=hosts)
        started = time.perf_counter()
        egress.start_proxy(run_id, policy, labels, image, time.time() + 600)
        egress.wait_ready()
        seconds = time.perf_counter() - started
        stats = client.api.stats(egress.container_id, stream=False)
        memory = stats.get("memory_stats", {}).get("usage", 0) / 2**20
    finally:
        egress.remove()
    return {"seconds": seconds, "memory_mb": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = [1, 1000, 5000, MAX_HOSTS, 2 * MAX_HOSTS]
    parser.add_argument("--sizes", type=int, nargs="+", default=default)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    client = connect()
    image = ensure_egress_image(client, progress=print)
    rows = []
    for wildcard in (False, True):
        for size in args.sizes:
            load = context.load()
            tries = [start_once(client, image, names(size, wildcard)) for _ in range(args.repeat)]
            rows.append(
                {
                    "hosts": size,
                    "kind": "wildcards" if wildcard else "names",
                    "seconds_median": round(statistics.median(t["seconds"] for t in tries), 2),
                    "seconds_max": round(max(t["seconds"] for t in tries), 2),
                    "memory_mb_median": round(statistics.median(t["memory_mb"] for t in tries), 1),
                    "load_before": load,
                }
            )
            print(rows[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {**context.header(client), "max_hosts": MAX_HOSTS, "rows": rows}
    (RESULTS / "egress_hosts.json").write_text(json.dumps(report, indent=2))
    lines = [
        "# The egress proxy's start with a long allowlist",
        "",
        f"{context.summary(report)}. Median of {args.repeat} starts each; the maximum an "
        f"allowlist may list is {MAX_HOSTS:,}; 1 name is the floor.",
        "",
        "| hosts | listed as | squid listening after (median, max) | memory | load before |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['hosts']:,} | {r['kind']} | {r['seconds_median']} s, {r['seconds_max']} s "
            f"| {r['memory_mb_median']} MiB | {r['load_before']} |"
        )
    (RESULTS / "egress_hosts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
