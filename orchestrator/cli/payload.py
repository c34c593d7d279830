"""`orchestrator validate` and `orchestrator cleanup`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..registry import DEFAULT_BACKEND, backend_names, backends_help
from .output import say
from .parser import HELP


def add_payload_parser(sub: Any) -> None:
    p = sub.add_parser(
        "validate",
        help=HELP["validate"],
        description="Check a payload without running it: its manifest, what its folder would "
        "ship, and (unless --no-load) that its agent tree loads in a sandbox with the mock "
        "model and placeholder secrets, no step run; every problem is reported at once "
        "(a missing function, an import error, mock scripts for unknown agents or missing "
        "for known ones). Exit codes: 0 ok, 2 problems found, 5 the sandbox could not run.",
    )
    p.add_argument(
        "payload", help="payload folder (holding manifest.toml), or a shipped example's name"
    )
    p.add_argument(
        "--no-load", action="store_true",
        help="check the manifest and files only (no sandbox; faster, finds less)",
    )  # fmt: skip
    p.add_argument(
        "--backend", choices=backend_names(),
        help=f"where to load it: {backends_help()}. Default: the payload's `payload.backend`, "
        "else docker",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.set_defaults(handler=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from ..errors import OrchestratorError
    from ..manifest import load_manifest

    report: dict[str, Any] = {"payload": args.payload, "ok": False, "problems": []}
    try:
        manifest = load_manifest(args.payload)
        report.update(payload=manifest.name, manifest=str(manifest.path))
        report["files"] = len(manifest.payload_files())  # what would be shipped, checked
    except OrchestratorError as exc:
        if not args.json:
            raise
        report["problems"] = exc.problem_lines()  # every problem of the manifest, one each
        report["details"] = [p.to_dict() for p in exc.problems]  # field path, line, fix
        print(json.dumps(report, indent=2))
        return exc.exit_code
    dangerous = manifest.dangerous_imports()
    report["warnings"] = (
        [f"dangerous authorized_imports {dangerous} need --i-understand-dangerous-imports"]
        if dangerous
        else []
    )
    code = 0
    missing = manifest.missing_function()  # from the source: the functions that do exist
    if missing:
        report["problems"].append(
            f"{manifest.path}: field `payload.entrypoint` {missing}. Fix the name, or define it."
        )
        code = 2
    elif not args.no_load:
        code = load_check(args, manifest.example_task, report)
    report["ok"] = not report["problems"]
    if args.json:
        print(json.dumps(report, indent=2))
        return code
    for problem in report["problems"]:
        say(problem, kind="problem")
    for warning in report["warnings"]:
        say(warning, kind="warning")
    if report["ok"]:
        loaded = f", agents {', '.join(report['agents'])}" if report.get("agents") else ""
        print(
            f"{report['manifest']}: ok ({report['payload']}, entrypoint {manifest.entrypoint}, "
            f"{report['files']} files to ship{loaded})"
        )
    return code


def load_check(args: argparse.Namespace, example_task: str | None, report: dict) -> int:
    """Load the payload's tree in a sandbox (mock model, no step); fill `report`; exit code."""
    from ..runner import run
    from ..spec import PAYLOAD_ERROR, RunSpec

    spec = RunSpec(
        payload=args.payload,
        task=example_task or "(validation: no step runs)",
        model="mock",
        backend=args.backend,
        network="none",
        timeout_seconds=120,
        allow_dangerous_imports=True,  # reported as a warning above; loading is not running
        check_only=True,
    )
    result = run(spec)
    report["check_run"] = result.run_id
    if result.status == "succeeded":
        report["agents"] = (result.answer or {}).get("agents", [])
        return 0
    error = result.error or {}
    if error.get("type") == PAYLOAD_ERROR:
        report["problems"] += error.get("problems") or [error.get("message")]
        return 2
    report["problems"].append(
        f"the payload could not be loaded in a sandbox ({result.status}: {error.get('message')})"
    )
    return result.cli_exit_code


def add_cleanup_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cleanup",
        help=HELP["cleanup"],
        description="Remove sandboxes (and their networks) whose orchestrator process is gone, "
        "and close their run records as infra_error.",
    )
    p.add_argument(
        "--backend", default=DEFAULT_BACKEND, choices=backend_names(),
        help=f"whose leftovers to remove: {backends_help()}",
    )  # fmt: skip
    p.add_argument(
        "--all-stores", action="store_true", help="consider sandboxes of every state directory"
    )
    p.add_argument(
        "--force", action="store_true", help="also remove sandboxes whose orchestrator still runs"
    )
    p.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    p.add_argument("--json", action="store_true", help="print the report as a JSON object")
    p.set_defaults(handler=cmd_cleanup)


def cmd_cleanup(args: argparse.Namespace) -> int:
    from ..backends import get_backend
    from ..cleanup import cleanup

    report = cleanup(
        get_backend(args.backend),
        all_stores=args.all_stores,
        force=args.force,
        dry_run=args.dry_run,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "dry_run": args.dry_run,
                    "removed": [sandbox_dict(info) for info in report.removed],
                    "kept": [sandbox_dict(info) for info in report.kept],
                    "closed_runs": report.closed_runs,
                },
                indent=2,
            )
        )
        return 0
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


def sandbox_dict(info: Any) -> dict[str, Any]:
    return {"kind": info.kind, "name": info.name, "run_id": info.labels.get("orchestrator.run-id")}
