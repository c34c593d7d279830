"""What the secret interceptor adds to one HTTPS request, on this host (no containers yet):
the same request to a local HTTPS server with its own CA, side by side in one run,

- tunnel: through a plain CONNECT proxy (the stand-in for squid of tests/https_upstream.py:
  the bytes relayed, nothing decrypted), as an `allowlist` run's requests go today;
- intercepted: through the interceptor (images/interceptor/interceptor.py, mitmproxy from
  .venv-mitmproxy) chained in front of the same CONNECT proxy, with a bound secret's
  placeholder in a header replaced by its value on the way.

Each path is timed twice: on one kept-alive connection (`requests.Session`), and with a new
connection (CONNECT + TLS) per request. A first figure for the interception's cost; the one
the issue asks for (interceptor and squid as the run's containers) comes with the wiring.
Run by hand (not a test; under a minute):

    python benchmarks/interception_latency.py [--requests 200]

Writes benchmarks/results/interception_latency.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402
import requests  # noqa: E402

from tests.backends.docker.test_interceptor import NAMES, PLACEHOLDER, VALUE, start_interceptor  # noqa: E402
from tests.https_upstream import https_upstream  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def timed(proxy: str, verify: str, count: int, *, keep_alive: bool) -> list[float]:
    """Milliseconds per GET of https://api.example.com/ through `proxy`, after 10 untimed."""
    headers = {"X-Api-Key": PLACEHOLDER}
    times = []
    session = requests.Session()
    for i in range(10 + count):
        if not keep_alive:
            session.close()
            session = requests.Session()
        session.proxies = {"https": proxy}
        session.verify = verify
        session.trust_env = False
        started = time.perf_counter()
        response = session.get(f"https://api.example.com/b{i}", headers=headers)
        elapsed = (time.perf_counter() - started) * 1000
        assert response.status_code == 200, response.text
        if i >= 10:
            times.append(elapsed)
    session.close()
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p95_ms": round(ordered[int(len(ordered) * 0.95) - 1], 3),
        "mean_ms": round(statistics.fmean(ordered), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="timed requests per path")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory() as folder,
        https_upstream(Path(folder), NAMES) as (
            upstream,
            upstream_ca,
        ),
    ):
        interceptor = start_interceptor(Path(folder), upstream, upstream_ca)
        try:
            tunnel = f"http://127.0.0.1:{upstream.proxy_port}"
            for keep_alive in (True, False):
                how = "kept-alive" if keep_alive else "new connection"
                results[f"tunnel, {how}"] = summary(
                    timed(tunnel, str(upstream_ca), args.requests, keep_alive=keep_alive)
                )
                results[f"intercepted, {how}"] = summary(
                    timed(
                        interceptor.url,
                        str(interceptor.ca_cert),
                        args.requests,
                        keep_alive=keep_alive,
                    )
                )
            assert all(VALUE in json.dumps(r["headers"]) for r in upstream.requests[-5:])
        finally:
            interceptor.process.terminate()
            interceptor.process.wait(timeout=30)
    data = {"requests": args.requests, **context.header(), "paths": results}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "interception_latency.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# HTTPS request through the secret interceptor vs a plain tunnel (this host)",
        "",
        f"{args.requests} timed requests per path; {context.summary(data)}.",
        "",
        "| path | median ms | p95 ms | mean ms |",
        "|---|---|---|---|",
    ]
    for name, row in results.items():
        lines.append(f"| {name} | {row['median_ms']} | {row['p95_ms']} | {row['mean_ms']} |")
    (RESULTS / "interception_latency.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
