"""`orchestrator view`: serve the web viewer over the store, or `--export DIR` it as static
HTML."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .common import tidy_store

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
        help="browse runs, agent trees, batches and schedules in a local web page",
        description="A local web viewer over the run store: runs (filters, search), a run's "
        "agent tree with every step, batches (accuracy, charts, comparisons), schedules.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "items", nargs="*", metavar="RUN_ID|BATCH_DIR",
        help="batch output folders to show with their scores; with --export, also run ids",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free one)")
    p.add_argument("--schedules", metavar="FILE", help="schedules file, for next fire times "
                   "(default: schedules.toml here, if there is one)")  # fmt: skip
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
    from ..store import Store
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


def serve(app: Any, host: str, port: int, token: str | None) -> int:
    """Run uvicorn in the foreground; the address (and token) are printed once it listens."""
    import asyncio

    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()[1]
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{bound}/"
            if token:
                url += f"?token={token}"
                print(
                    "access token required on this address: open the URL below (it sets a "
                    "cookie); without the token nothing is served",
                    file=sys.stderr,
                    flush=True,
                )
            print(f"orchestrator view: {url}", flush=True)
        await task

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 5
