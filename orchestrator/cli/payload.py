"""`orchestrator validate` and `orchestrator cleanup`."""

from __future__ import annotations

import argparse
from typing import Any

from ..spec import BACKENDS


def add_payload_parser(sub: Any) -> None:
    p = sub.add_parser("validate", help="validate a payload's manifest without running it")
    p.add_argument("payload")
    p.set_defaults(handler=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from ..manifest import load_manifest

    manifest = load_manifest(args.payload)
    files = manifest.payload_files()  # what would be shipped, checked the same way
    print(
        f"{manifest.path}: ok ({manifest.name}, entrypoint {manifest.entrypoint}, "
        f"{len(files)} files to ship)"
    )
    dangerous = manifest.dangerous_imports()
    if dangerous:
        print(
            f"warning: dangerous authorized_imports {dangerous} "
            "need --i-understand-dangerous-imports"
        )
    return 0


def add_cleanup_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cleanup",
        help="remove sandboxes left behind by a crashed orchestrator",
        description="Remove sandboxes (and their networks) whose orchestrator process is gone, "
        "and close their run records as infra_error.",
    )
    p.add_argument(
        "--backend", default="docker", choices=BACKENDS,
        help="docker: containers and networks on this host; e2b: sandboxes listed by metadata",
    )  # fmt: skip
    p.add_argument(
        "--all-stores", action="store_true", help="consider sandboxes of every state directory"
    )
    p.add_argument(
        "--force", action="store_true", help="also remove sandboxes whose orchestrator still runs"
    )
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(handler=cmd_cleanup)


def cmd_cleanup(args: argparse.Namespace) -> int:
    from ..cleanup import cleanup
    from ..runner import get_backend

    report = cleanup(
        get_backend(args.backend),
        all_stores=args.all_stores,
        force=args.force,
        dry_run=args.dry_run,
    )
    verb = "would remove" if args.dry_run else "removed"
    for info in report.removed:
        print(f"{verb} {info.kind} {info.name} (run {info.labels.get('orchestrator.run-id')})")
    for info in report.kept:
        print(f"kept {info.kind} {info.name}: its orchestrator is still running (use --force)")
    for run_id in report.closed_runs:
        print(f"closed run {run_id} as infra_error")
    if not (report.removed or report.kept or report.closed_runs):
        print("nothing to clean up")
    return 0
