"""The cost per HTTPS request from a sandbox through the run's secret interceptor, against
the same request through a plain CONNECT tunnel as today's squid path makes it, side by side
in one run (issue 43).

Both from a real sandbox (the agent image; runc and gVisor, `--runtimes`), to the tests' HTTPS
server with its own CA on this host (tests/https_upstream.py), through its CONNECT stand-in
for squid (the bytes relayed, nothing decrypted, as squid splices):

- `tunnel`: an open-network run whose requests go to the stand-in directly: one proxy hop,
  as an allowlist run's requests go through squid today;
- `intercepted`: a run with a bound secret: its requests go through the run's interceptor
  container (mitmproxy), then the same stand-in (`InterceptorRoute`, the tests' seam); each
  carries the secret's placeholder in a header, replaced by the value on the way.

Why not squid itself: squid refuses private addresses (the local server) by design, and on
the development machine every name resolves to its network's TLS gateway, where squid's
CONNECT to port 443 fails (ERR_CANNOT_FORWARD): no public HTTPS host is reachable from a
sandbox there. The stand-in stands for squid on both paths, so the difference is the
interceptor's hop.

In each run the payload's tool times GETs from inside the sandbox, on one kept-alive
connection and with a new connection (CONNECT, TLS) per request; each run's wall time is kept
too (a bound run starts its interceptor container). The machine is small and shared (2
cores): the paths alternate run by run (the order flips each round); figures are medians.

    .venv/bin/python benchmarks/secret_interception.py [--rounds 5] [--requests 40]
        [--runtimes runc,runsc]

Writes benchmarks/results/secret_interception.json and .md; needs Docker and the agent and
interceptor images.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402

from orchestrator import RunSpec, run  # noqa: E402
from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.backend import DockerBackend  # noqa: E402
from orchestrator.backends.docker.interceptor import InterceptorRoute  # noqa: E402
from tests.https_upstream import https_upstream  # noqa: E402
from tests.model_server import docker_bridge_address  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
HOST = "api.example.com"
URL = f"https://{HOST}/bench"
TOKEN = "BENCH_TOKEN"
PATHS = ("tunnel", "intercepted")
UNTIMED = 5

MANIFEST = """\
[payload]
name = "https_timing_{path}"
description = "Benchmark payload: times HTTPS requests from inside the sandbox."
entrypoint = "timing:build"
example_task = "Time the requests."

[python]
authorized_imports = []

[network]
hosts = ["{host}"]

[secrets]
required = ["{token}"]
{bind}
[limits]
max_steps = 2
timeout_seconds = 600
memory_mb = 256
pids = 64

[mock.scripts]
manager = [\"\"\"Thought: I will time the requests.
<code>
final_answer(timing(url=url, count=count, proxy=proxy, ca=ca))
</code>\"\"\"]
"""

TOOL = f'''"""Times GETs of a URL from inside the sandbox (benchmarks/secret_interception.py)."""

import json
import os
import time
from pathlib import Path

import requests
from smolagents import CodeAgent, tool


def _session(proxy: str, ca: str) -> requests.Session:
    """The environment's proxy and CA bundle, or the ones given (the tunnel's run)."""
    session = requests.Session()
    if proxy:
        session.trust_env = False
        session.proxies = {{"https": proxy}}
        session.verify = ca
    return session


def _timed(url: str, count: int, keep_alive: bool, proxy: str, ca: str) -> list[float]:
    session = _session(proxy, ca)
    headers = {{"X-Api-Key": os.environ["{TOKEN}"]}}
    times = []
    for i in range({UNTIMED} + count):
        if not keep_alive:
            session.close()
            session = _session(proxy, ca)
        started = time.perf_counter()
        response = session.get(url, headers=headers, timeout=30)
        elapsed = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            raise RuntimeError(f"{{url}}: {{response.status_code}}")
        if i >= {UNTIMED}:
            times.append(round(elapsed, 3))
    session.close()
    return times


@tool
def timing(url: str, count: int, proxy: str, ca: str) -> str:
    """Time `count` GETs of `url` on one kept-alive connection, then with a new one each.

    Args:
        url: the HTTPS URL to get.
        count: how many timed requests each way.
        proxy: the proxy to use ("": the environment's).
        ca: the CA certificate (PEM) to trust with `proxy`.
    """
    bundle = ""
    if proxy:
        bundle = "/tmp/bench-ca.pem"
        Path(bundle).write_text(ca)
    return json.dumps(
        {{
            "kept_alive": _timed(url, count, True, proxy, bundle),
            "new_connection": _timed(url, count, False, proxy, bundle),
        }}
    )


def build(model):
    return CodeAgent(tools=[timing], model=model, max_steps=2)
'''


def make_payloads(folder: Path) -> dict[str, Path]:
    """The two payloads, the same but for the `[secrets.bind]` table."""
    bind = f'\n[secrets.bind]\n{TOKEN} = {{ hosts = ["{HOST}"], in = ["header"] }}\n'
    payloads = {}
    for path in PATHS:
        directory = folder / path
        directory.mkdir()
        text = MANIFEST.format(
            path=path, host=HOST, token=TOKEN, bind=bind if path == "intercepted" else ""
        )
        (directory / "manifest.toml").write_text(text)
        (directory / "timing.py").write_text(TOOL)
        payloads[path] = directory
    return payloads


def one_run(spec: RunSpec, backend: DockerBackend, count: int) -> dict[str, Any]:
    """One run's in-sandbox timings, its wall time and its sandbox runtime."""
    started = time.monotonic()
    result = run(spec, backend=backend)
    wall = time.monotonic() - started
    if result.status != "succeeded":
        raise SystemExit(f"{spec.payload}: {result.status}: {result.error}")
    runtime = (result.sandbox or {}).get("runtime")
    injected = sum(int(e.get("count") or 0) for e in result.secrets_injected)
    assert injected == (0 if spec.network == "open" else 2 * (UNTIMED + count)), injected
    return {**json.loads(result.answer), "wall_s": round(wall, 3), "runtime": runtime}


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def p90(values: list[float]) -> float:
    """The smallest value at or above 90 % of them."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(len(ordered) * 0.9) - 1)], 3)


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians (and p90s) over every request of `runs`, and their wall times' median."""
    kept = [t for r in runs for t in r["kept_alive"]]
    new = [t for r in runs for t in r["new_connection"]]
    return {
        "kept_alive_median_ms": median(kept),
        "kept_alive_p90_ms": p90(kept),
        "new_connection_median_ms": median(new),
        "new_connection_p90_ms": p90(new),
        "run_wall_median_s": median([float(r["wall_s"]) for r in runs]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs per path (alternating)")
    parser.add_argument("--requests", type=int, default=40, help="timed requests per way")
    parser.add_argument(
        "--runtimes", default="runc,runsc", help="sandbox runtimes, comma-separated"
    )
    args = parser.parse_args()
    runtimes = tuple(args.runtimes.split(","))
    os.environ[TOKEN] = "bench-value-" + os.urandom(8).hex()
    load_before = context.load()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        rt: {path: [] for path in PATHS} for rt in runtimes
    }
    address = docker_bridge_address()
    with (
        tempfile.TemporaryDirectory() as folder,
        https_upstream(Path(folder), [HOST], address=address) as (server, ca),
    ):
        payloads = make_payloads(Path(folder))
        stand_in = f"http://{address}:{server.proxy_port}"
        client = connect()
        backends = {
            "tunnel": DockerBackend(client),
            "intercepted": DockerBackend(
                client, interceptor_route=InterceptorRoute(stand_in, ca.read_text())
            ),
        }
        given = {"tunnel": (stand_in, ca.read_text()), "intercepted": ("", "")}
        for number in range(args.rounds):
            order = PATHS if number % 2 == 0 else PATHS[::-1]
            for runtime in runtimes:
                for path in order:
                    proxy, pem = given[path]
                    spec = RunSpec(
                        payload=payloads[path],
                        network="open" if path == "tunnel" else None,
                        sandbox_runtime=runtime,
                        additional_args={
                            "url": URL,
                            "count": args.requests,
                            "proxy": proxy,
                            "ca": pem,
                        },
                    )
                    done = one_run(spec, backends[path], args.requests)
                    assert done["runtime"] == runtime, done["runtime"]
                    runs[runtime][path].append(done)
                    print(f"round {number + 1}: {runtime} {path} done", file=sys.stderr)
        # Every request arrived with the value: the tunnel's held it (unbound), the
        # intercepted run's had it put in place of its placeholder.
        arrived = [r["headers"].get("X-Api-Key") for r in server.requests]
        expected = args.rounds * len(runtimes) * len(PATHS) * 2 * (UNTIMED + args.requests)
        assert arrived == [os.environ[TOKEN]] * expected, (len(arrived), expected)
    figures = {rt: {path: summarize(runs[rt][path]) for path in PATHS} for rt in runtimes}
    data = {
        **context.header(client),
        "load_before": load_before,
        "load_after": context.load(),
        "rounds": args.rounds,
        "requests_per_way_per_run": args.requests,
        "figures": figures,
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "secret_interception.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# HTTPS from a sandbox: through the secret interceptor vs a plain tunnel",
        "",
        f"{context.summary(data)}; per sandbox runtime, {args.rounds} runs per "
        "path, alternating (the order flips each round, the runtimes take turns), "
        f"{args.requests} timed GETs each way per run, timed inside the sandbox, to a local "
        "HTTPS server through a CONNECT stand-in for squid; medians over all runs; load "
        f"{data['load_before']} before, {data['load_after']} after.",
        "",
        "| runtime | path | kept-alive median ms | p90 ms | new connection median ms "
        "| p90 ms | run wall median s |",
        "|---|---|---|---|---|---|---|",
    ]
    for runtime in runtimes:
        for path in PATHS:
            row = figures[runtime][path]
            lines.append(
                f"| {runtime} | {path} | {row['kept_alive_median_ms']} "
                f"| {row['kept_alive_p90_ms']} | {row['new_connection_median_ms']} "
                f"| {row['new_connection_p90_ms']} | {row['run_wall_median_s']} |"
            )
    lines.append("")
    for runtime in runtimes:
        tunnel, inter = figures[runtime]["tunnel"], figures[runtime]["intercepted"]
        kept = round(inter["kept_alive_median_ms"] - tunnel["kept_alive_median_ms"], 3)
        new = round(inter["new_connection_median_ms"] - tunnel["new_connection_median_ms"], 3)
        wall = round(inter["run_wall_median_s"] - tunnel["run_wall_median_s"], 3)
        lines.append(
            f"- {runtime}: the interception adds **{kept} ms** per request on a kept-alive "
            f"connection, **{new} ms** with a new connection each, and **{wall} s** to a run "
            "(its interceptor container's start)."
        )
    (RESULTS / "secret_interception.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
