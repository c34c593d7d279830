"""Run the E2B test server standalone: `python -m tests.e2b_server --port 3000`."""

from __future__ import annotations

import argparse
import signal
import threading

from .cloud import DEFAULT_API_KEY, DEFAULT_IMAGE
from .server import E2BTestServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--api-key", default=DEFAULT_API_KEY)
    parser.add_argument(
        "--template",
        action="append",
        default=[],
        metavar="ID=IMAGE",
        help=f"map a templateID to a local image (default: base={DEFAULT_IMAGE})",
    )
    parser.add_argument("--default-user", default=None, help="user for commands and files")
    parser.add_argument("--max-concurrent", type=int, default=None)
    args = parser.parse_args(argv)

    templates = {"base": DEFAULT_IMAGE}
    for item in args.template:
        template_id, _, image = item.partition("=")
        templates[template_id] = image or DEFAULT_IMAGE
    server = E2BTestServer(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        templates=templates,
        default_user=args.default_user,
        max_concurrent=args.max_concurrent,
    )
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with server:
        print(f"E2B test server on {server.url}; point the SDK at it with:", flush=True)
        for key, value in server.env().items():
            print(f"  export {key}={value}", flush=True)
        stop.wait()
    print("stopped; all sandbox containers removed")


if __name__ == "__main__":
    main()
