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
    parser.add_argument(
        "--base-image",
        action="append",
        default=[],
        metavar="REF=IMAGE",
        help="map a template build's fromImage ref to a local image (nothing can be pulled)",
    )
    parser.add_argument(
        "--keep-images", action="store_true", help="keep the images of template builds on exit"
    )
    parser.add_argument("--default-user", default=None, help="user for commands and files")
    parser.add_argument("--max-concurrent", type=int, default=None)
    args = parser.parse_args(argv)

    templates = {"base": DEFAULT_IMAGE}
    for item in args.template:
        template_id, _, image = item.partition("=")
        templates[template_id] = image or DEFAULT_IMAGE
    base_images = dict(item.partition("=")[::2] for item in args.base_image)
    server = E2BTestServer(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        templates=templates,
        default_user=args.default_user,
        max_concurrent=args.max_concurrent,
        base_images=base_images,
        keep_images=args.keep_images,
    )
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with server:
        print(f"E2B test server on {server.url}; point the SDK at it with:", flush=True)
        for key, value in server.env().items():
            print(f"  export {key}={value}", flush=True)
        stop.wait()
    print("stopped; sandbox containers (and template images, unless kept) removed")


if __name__ == "__main__":
    main()
