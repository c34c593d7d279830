"""What the model gateway costs on E2B: sandboxes, start time and latency per model call,
measured side by side in one run against the local E2B test server (`tests/e2b_server`).

- start: the run's sandbox made by the E2B backend (`E2BBackend.create`) without a gateway,
  and with one (`create` makes the gateway's sandbox first, then `GatewayHandle.open` hands it
  its configuration and waits until it listens), alternating, `--starts` of each; what a
  gateway shared by a batch would save per run is the difference;
- latency: from inside the run's sandbox, the same chat-completions call to the scripted model
  server on this host straight (as `--no-gateway` does) and through the run's gateway (E2B's
  per-port host name, the test server's edge, the gateway's sandbox, then the server), one
  keep-alive connection each, `--calls` timed calls per path in alternating rounds; and, to
  tell the gateway's cost from the edge's, straight to the gateway's container address (the
  test server's own shortcut, which E2B does not have).

Run by hand (not a test; a few minutes, the template build included):

    python benchmarks/e2b_gateway.py [--calls 300] [--starts 5]

Writes benchmarks/results/e2b_gateway.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402

from orchestrator.backends.base import SandboxSpec  # noqa: E402
from orchestrator.backends.e2b import E2BSettings  # noqa: E402
from orchestrator.backends.e2b.gateway import GATEWAY_PORT  # noqa: E402
from orchestrator.backends.e2b.sandbox import E2BBackend, E2BSandbox  # noqa: E402
from orchestrator.backends.e2b.templates import PYTHON, SANDBOX_USER  # noqa: E402
from orchestrator.gateway import GatewaySpec  # noqa: E402
from orchestrator.labels import run_labels  # noqa: E402
from orchestrator.spec import Limits, NetworkPolicy  # noqa: E402
from tests.e2b_server import E2BTestServer  # noqa: E402
from tests.e2b_server.fixtures import base_image  # noqa: E402
from tests.model_server import ScriptedModelServer, docker_bridge_address  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"

#: The client (as benchmarks/gateway_latency.py's): one keep-alive connection, `calls` timed
#: POSTs after `warmup` untimed ones; prints the latencies in milliseconds as JSON.
CLIENT = r"""
import http.client, json, sys, time, urllib.parse
url, token, calls, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
parts = urllib.parse.urlsplit(url)
conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
body = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "Hi"}]})
headers = {"Authorization": "Bearer " + token, "Content-Type": "application/json"}
times = []
for i in range(warmup + calls):
    started = time.perf_counter()
    conn.request("POST", parts.path + "/chat/completions", body, headers)
    reply = conn.getresponse()
    data = reply.read()
    assert reply.status == 200, (reply.status, data[:200])
    if i >= warmup:
        times.append((time.perf_counter() - started) * 1000)
print(json.dumps(times))
"""


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(len(ordered) * 0.9)], 3),
        "mean_ms": round(statistics.fmean(ordered), 3),
    }


def client(sandbox: E2BSandbox, url: str, token: str, calls: int) -> list[float]:
    import shlex

    command = " ".join(shlex.quote(a) for a in (PYTHON, "-c", CLIENT, url, token, str(calls), "20"))
    done = sandbox.sandbox.commands.run(command, user=SANDBOX_USER, timeout=600)
    return list(json.loads(done.stdout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="timed calls per path and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per path")
    parser.add_argument("--starts", type=int, default=5, help="sandbox starts per kind")
    args = parser.parse_args()
    key = "sk-bench-" + secrets.token_hex(16)
    outputs = ["Thought: ok.\n<code>\nfinal_answer(1)\n</code>"] * (
        (args.calls + 20) * args.rounds * 3 + 10
    )
    base = base_image()
    starts: dict[str, list[float]] = {
        "without_gateway": [],
        "with_gateway": [],
        "with_gateway_created": [],
    }
    paths: dict[str, list[float]] = {"direct": [], "gateway_by_address": [], "through_gateway": []}
    load_before = context.load()
    with ScriptedModelServer(outputs) as model, E2BTestServer(templates={"base": base}) as server:
        os.environ.update(server.env())
        os.environ["ORCHESTRATOR_E2B_BASE_IMAGE"] = base
        backend = E2BBackend(E2BSettings.from_env())
        template = backend.prepare_image((), lambda m: print(m, file=sys.stderr))
        upstream = model.api_base(docker_bridge_address())

        def spec(gateway: bool) -> SandboxSpec:
            run_id = f"bench-e2bgw-{secrets.token_hex(4)}"
            plan = GatewaySpec(
                upstream=upstream,
                token=secrets.token_urlsafe(32),
                max_calls=100_000,
                max_tokens=10**9,
                credential_env="OPENAI_API_KEY",
            )
            return SandboxSpec(
                run_id=run_id,
                image=template,
                command=(),
                limits=Limits(timeout_seconds=900),
                network=NetworkPolicy("allowlist"),
                labels=run_labels(run_id),
                gateway=plan if gateway else None,
            )

        for _ in range(args.starts):
            for kind in ("without_gateway", "with_gateway"):
                started = time.perf_counter()
                sandbox = backend.create(spec(kind == "with_gateway"), lambda _m: None)
                try:
                    if sandbox.gateway is not None:
                        starts["with_gateway_created"].append(time.perf_counter() - started)
                        sandbox.gateway.open(key)
                    starts[kind].append(time.perf_counter() - started)
                finally:
                    sandbox.remove()
        run_spec = spec(True)
        sandbox = backend.create(run_spec, lambda _m: None)
        try:
            assert sandbox.gateway is not None
            sandbox.gateway.open(key)
            token = run_spec.gateway.token if run_spec.gateway else ""
            address = server.container_address(server.sandbox(sandbox.gateway.id))
            urls = {
                "direct": (upstream, key),
                "gateway_by_address": (f"http://{address}:{GATEWAY_PORT}/v1", token),
                "through_gateway": (sandbox.gateway.api_base, token),
            }
            for _ in range(args.rounds):
                for name, (url, credential) in urls.items():
                    paths[name] += client(sandbox, url, credential, args.calls)
        finally:
            if sandbox.gateway is not None:
                sandbox.gateway.close()
            sandbox.remove()
        assert server.alive_count() == 0
    figures: dict[str, Any] = {
        **context.header(),
        "load_before": load_before,
        "calls_per_path": len(paths["direct"]),
        **{name: summary(times) for name, times in paths.items()},
        "starts_per_kind": args.starts,
        "start_median_s": {k: round(statistics.median(v), 3) for k, v in starts.items()},
        "sandboxes_per_run": {"without_gateway": 1, "with_gateway": 2},
    }
    figures["added_median_ms"] = round(
        figures["through_gateway"]["median_ms"] - figures["direct"]["median_ms"], 3
    )
    figures["added_start_s"] = round(
        figures["start_median_s"]["with_gateway"] - figures["start_median_s"]["without_gateway"], 3
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "e2b_gateway.json").write_text(json.dumps(figures, indent=2) + "\n")
    table = [
        "# The model gateway on E2B (local E2B test server)",
        "",
        f"{context.summary(figures)}; load {figures['load_before']:.2f} before. "
        f"{figures['calls_per_path']} calls per path in {args.rounds} alternating rounds (one "
        f"keep-alive connection each) from inside the run's sandbox; {args.starts} sandbox "
        "starts of each kind, alternating.",
        "",
        "| path | median ms | p90 ms | mean ms |",
        "|---|---|---|---|",
    ]
    for name in paths:
        f = figures[name]
        table.append(f"| {name} | {f['median_ms']} | {f['p90_ms']} | {f['mean_ms']} |")
    table += [
        "",
        "| run's sandbox | sandboxes | median start s |",
        "|---|---|---|",
        f"| without gateway | 1 | {figures['start_median_s']['without_gateway']} |",
        f"| with gateway (both made) | 2 | {figures['start_median_s']['with_gateway_created']} |",
        f"| with gateway (ready) | 2 | {figures['start_median_s']['with_gateway']} |",
        "",
        f"The gateway adds **{figures['added_median_ms']} ms** per call at the median and "
        f"**{figures['added_start_s']} s** to a run's start, and takes a second sandbox.",
    ]
    (RESULTS / "e2b_gateway.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
