"""`orchestrator view`: serve the web viewer over the store, or `--export DIR` it as static
HTML."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .common import tidy_store
from .output import say
from .parser import HELP

EPILOG = """\
Serving: http://127.0.0.1:8765/ by default. Any other --host (0.0.0.0, a LAN address) needs
the access token printed at start: open the printed URL once (it sets a cookie); without the
token nothing is served. Stop with Ctrl-C.

Batches: give their output folders (orchestrator view out/ other-out/) to see scores,
expected answers, charts and comparisons; runs of other batches are listed from the store.

Export: orchestrator view --export DIR RUN_ID|BATCH_DIR ... writes static pages to DIR (open
DIR/index.html from disk; no server, no network).
"""


def add_view_parser(sub: Any) -> None:
    p = sub.add_parser(
        "view",
        help=HELP["view"],
        description="A local web viewer over the run store: runs (filters, search), a run's "
        "agent tree with every step, batches (accuracy, charts, comparisons), schedules.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="RUN_ID|BATCH_DIR",
        help="batch output folders to show with their scores; with --export, also run ids",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free one)")
    p.add_argument(
        "--schedules",
        metavar="FILE",
        help="schedules file, for next fire times (default: schedules.toml here, if there is one)",
    )
    p.add_argument("--export", metavar="DIR", help="write static HTML to DIR instead of serving")
    p.set_defaults(handler=cmd_view)


def schedules_file(args: argparse.Namespace) -> Path | None:
    if args.schedules:
        path = Path(args.schedules)
        if not path.is_file():
            raise ConfigError(f"No schedules file at {path}.", "Give an existing --schedules FILE.")
        return path
    default = Path("schedules.toml")
    return default if default.is_file() else None


def cmd_view(args: argparse.Namespace) -> int:
    from ..records.store import Store
    from ..view import Batches, create_app, export, is_loopback, new_token

    tidy_store()
    store = Store()
    if args.export:
        done = export(store, Path(args.export), args.items, schedules_file(args))
        print(
            f"exported {len(done.runs)} run(s) and {len(done.batches)} batch(es) to "
            f"{done.folder}/index.html"
        )
        return 0
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is not a port.", "Use 0 to 65535.")
    folders = []
    for item in args.items:
        if not Path(item).is_dir():
            raise ConfigError(
                f"{item!r} is not a batch output folder.",
                "Serving takes batch folders only; open a run from the runs page, or use "
                "--export DIR to write a run's page.",
            )
        folders.append(Path(item))
    batches = Batches(store, folders)
    token = None if is_loopback(args.host) else new_token()
    app = create_app(store, batches, schedules_file(args), token)
    return serve(app, args.host, args.port, token)


WILDCARDS = ("0.0.0.0", "::", "")


def addresses_of(host: str) -> list[str]:
    """The addresses to print for a --host: itself, or for a wildcard (every interface)
    this machine's own addresses that another machine can open, the default route's
    first; the host name if none is found."""
    import socket

    if host not in WILDCARDS:
        return [host]
    family = socket.AF_INET6 if host == "::" else socket.AF_INET
    found: list[str] = []
    probe = socket.socket(family, socket.SOCK_DGRAM)
    try:  # no packet is sent: connect() on UDP only picks the route's source address
        probe.connect(("2001:db8::1" if family == socket.AF_INET6 else "192.0.2.1", 80))
        found.append(probe.getsockname()[0])
    except OSError:
        pass
    finally:
        probe.close()
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, family)
    except OSError:
        infos = []
    found += [str(info[4][0]) for info in infos]
    usable = [a for a in dict.fromkeys(found) if not a.startswith(("127.", "::1"))]
    return usable or [socket.gethostname()]


def serve(app: Any, host: str, port: int, token: str | None) -> int:
    """Bind first (a port in use is a plain error, not a server traceback), print the address
    (and token), then run uvicorn in the foreground until Ctrl-C or SIGTERM."""
    import socket

    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"Cannot listen on {host}:{port}: {exc.strerror or exc}.",
            "Choose another --port (0: any free one), or a --host of this machine.",
        ) from exc
    bound = sock.getsockname()[1]
    query = f"?token={token}" if token else ""
    urls = [
        f"http://{f'[{name}]' if ':' in name else name}:{bound}/{query}"
        for name in addresses_of(host)
    ]
    if token:
        say(
            "access token required on this address: open the URL below (it sets a cookie); "
            "without the token nothing is served"
        )
    for other in urls[1:]:
        say(f"also served at {other}")
    print(f"orchestrator view: {urls[0]}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0
