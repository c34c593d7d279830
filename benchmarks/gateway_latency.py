"""What the model gateway adds to one model call: the same chat-completions call from a
container, straight to a model server on this host and through a real run gateway, measured
side by side in one run.

Both paths start in a container made from the agent image, as the sandbox's would:
- direct: the container is on the default bridge and calls the scripted model server on the
  Docker host (`host-gateway`), as a sandbox with `--network open --no-gateway` does;
- gateway: the container is on a private run network with a gateway container
  (`orchestrator_runtime/gateway`, started and configured by the Docker backend's own
  `Gateway`), which checks the token, swaps in the key and forwards to the same server.

Each path keeps one connection open (as the openai client does) and times `--calls` calls after
a warm-up. Run by hand (not a test; about a minute):

    python benchmarks/gateway_latency.py [--calls 300]

Writes benchmarks/results/gateway_latency.json and .md.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402

from orchestrator.backends.docker import connect  # noqa: E402
from orchestrator.backends.docker.deadline import deadline_at  # noqa: E402
from orchestrator.backends.docker.egress import Egress  # noqa: E402
from orchestrator.backends.docker.gateway import Gateway  # noqa: E402
from orchestrator.backends.docker.images import ensure_agent_image  # noqa: E402
from orchestrator.gateway import GatewaySpec  # noqa: E402
from orchestrator.policy import HOST_ALIAS  # noqa: E402
from orchestrator.spec import Limits  # noqa: E402
from tests.model_server import ScriptedModelServer  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"

#: The client: one keep-alive connection, `calls` timed POSTs after `warmup` untimed ones;
#: prints the latencies in milliseconds as JSON.
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


def client(image: str, network: str, url: str, token: str, calls: int, extra: list[str]) -> list:
    done = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            network,
            "--cap-drop",
            "ALL",
            "--user",
            "10001:10001",
            *extra,
            "--entrypoint",
            "python",
            image,
            "-c",
            CLIENT,
            url,
            token,
            str(calls),
            "20",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(len(ordered) * 0.9)], 3),
        "mean_ms": round(statistics.fmean(ordered), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="timed calls per path")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per path")
    args = parser.parse_args()
    docker = connect()
    image = ensure_agent_image(docker)
    key = "sk-bench-" + secrets.token_hex(16)
    run_id = f"bench-gw-{secrets.token_hex(4)}"
    labels = {"orchestrator.run-id": run_id}
    outputs = ["Thought: ok.\n<code>\nfinal_answer(1)\n</code>"] * (
        (args.calls + 20) * args.rounds * 2 + 10
    )
    direct: list[float] = []
    through: list[float] = []
    load_before = context.load()
    with ScriptedModelServer(outputs) as server:
        upstream = f"http://{HOST_ALIAS}:{server.port}/v1"
        spec = GatewaySpec(
            upstream=upstream,
            token=secrets.token_urlsafe(32),
            max_calls=100_000,
            max_tokens=10**9,
            credential_env="OPENAI_API_KEY",
            on_docker_host=True,
        )
        stop_at = deadline_at(Limits(timeout_seconds=600))
        network = Egress.start(docker, run_id=run_id, labels=labels)
        gateway = None
        try:
            gateway = Gateway.start(
                docker,
                run_id=run_id,
                spec=spec,
                network_id=network.network_id,
                network_name=network.network_name,
                labels=labels,
                image=image,
                stop_at=stop_at,
            )
            gateway.open(key)
            gateway.wait_ready()
            for _ in range(args.rounds):
                direct += client(
                    image,
                    "bridge",
                    upstream,
                    key,
                    args.calls,
                    ["--add-host", f"{HOST_ALIAS}:host-gateway"],
                )
                through += client(
                    image, network.network_name, gateway.api_base, spec.token, args.calls, []
                )
        finally:
            if gateway is not None:
                gateway.close()
                gateway.remove()
            network.remove()
    figures = {
        **context.header(docker),
        "load_before": load_before,
        "calls_per_path": len(direct),
        "direct": summary(direct),
        "through_gateway": summary(through),
    }
    figures["added_median_ms"] = round(
        figures["through_gateway"]["median_ms"] - figures["direct"]["median_ms"], 3
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway_latency.json").write_text(json.dumps(figures, indent=2) + "\n")
    table = [
        "# Model gateway latency",
        "",
        f"{context.summary(figures)}; {figures['calls_per_path']} calls per path "
        f"in {args.rounds} alternating rounds (one keep-alive connection each), load "
        f"{figures['load_before']:.2f} before.",
        "",
        "| path | median ms | p90 ms | mean ms |",
        "|---|---|---|---|",
    ]
    for name in ("direct", "through_gateway"):
        f = figures[name]
        table.append(f"| {name} | {f['median_ms']} | {f['p90_ms']} | {f['mean_ms']} |")
    table += ["", f"The gateway adds **{figures['added_median_ms']} ms** at the median."]
    (RESULTS / "gateway_latency.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
