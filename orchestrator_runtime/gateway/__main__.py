"""`python -m orchestrator_runtime.gateway`: one run's model gateway.

Talks to the host over its standard streams, never through files or its environment:

- stdin, first line: the configuration as one JSON object (`app.GatewayConfig`: the run
  token, the real key, the upstream, the run's networks, the budget);
- stdin, later lines: `stop` (the run has ended: refuse every call from now on, report the
  totals, exit). End of input means the same: a gateway whose host is gone serves nobody;
- stdout: one JSON event a line: `gateway_ready`, then `model_call`, `model_call_refused`,
  `budget_exceeded`, and last `gateway_closed` with the totals;
- stderr: diagnostics.

Exit codes: 0 after `stop`, 2 for a bad configuration.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from typing import Any


class Channel:
    """Events to the host: one JSON object a line on stdout, whole lines only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self._lock:
            sys.stdout.write(line)
            sys.stdout.flush()


def read_config() -> dict[str, Any]:
    """The configuration, stdin's first line; waits for it as long as the host takes (the
    container's deadline keeper ends a gateway whose host never sends it). Raises
    ValueError when the line is not one JSON object."""
    line = sys.stdin.readline()
    data = json.loads(line) if line.strip() else None
    if not isinstance(data, dict):
        raise ValueError("stdin's first line must be one JSON object")
    return data


def upstream_client() -> Any:
    """The client to the upstream. Made before the configuration comes (none of it depends
    on the run): its TLS context and its transport's imports take about 75 ms."""
    import httpx

    timeout = httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=30.0)
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=8)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def serve(raw_config: dict[str, Any], emit: Channel, client: Any) -> int:
    import uvicorn

    from .app import Gateway, GatewayConfig

    config = GatewayConfig.from_json(raw_config)
    async with client:
        app = Gateway(config, emit, client)
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="0.0.0.0",
                port=config.port,
                lifespan="off",
                access_log=False,
                log_level="warning",
                http="h11",
                loop="asyncio",
                server_header=False,
                date_header=False,
                timeout_graceful_shutdown=1,
                limit_concurrency=64,
            )
        )
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()

        def watch_stdin() -> None:  # `stop`, or the end of input: the run is over
            for line in sys.stdin:
                if line.strip() == "stop":
                    break
            loop.call_soon_threadsafe(stopped.set)

        threading.Thread(target=watch_stdin, name="gateway-control", daemon=True).start()
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()  # raises why it could not listen
                return 1
            await asyncio.sleep(0.005)
        emit({"type": "gateway_ready", "port": config.port})
        await stopped.wait()
        app.closed = True  # the token is refused from here on
        emit({"type": "gateway_closed", **app.ledger.summary()})
        server.should_exit = True
        await serving
    return 0


def main() -> int:
    emit = Channel()
    # Imported while the host is still starting the sandbox, before the configuration comes
    # (uvicorn's protocol modules too, which it would import only once serving).
    import uvicorn
    import uvicorn.lifespan.off
    import uvicorn.protocols.http.h11_impl
    import uvicorn.protocols.websockets.auto  # noqa: F401

    from . import app  # noqa: F401

    client = upstream_client()
    try:
        raw = read_config()
    except ValueError as exc:
        print(f"gateway: bad configuration: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(raw, emit, client))
    except ValueError as exc:
        print(f"gateway: bad configuration: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
