"""`orchestrator validate` and `orchestrator cleanup`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..options import option
from ..registry import DEFAULT_BACKEND, backend_names, backends_help
from .common import add_options, spec_from_args
from .output import say
from .parser import HELP

#: The run options `validate` takes, as `run` does: where the payload loads (the user's
#: default backend too), the secrets it looks up, its dangerous imports accepted.
VALIDATE_OPTIONS = ("backend", "env_file", "allow_dangerous_imports")


def add_payload_parser(sub: Any) -> None:
    p = sub.add_parser(
        "validate",
        help=HELP["validate"],
        description="Check a payload or a program without running it, as `run` checks it "
        "before it starts (a program: its `# /// script` block, its syntax, the models it "
        "makes, run up to its first agent run with no model called): "
        "its manifest, what its folder would ship, dangerous imports, that its declared "
        "secrets are set (their values go nowhere), and (unless --no-load) that its agent "
        "tree loads in a sandbox with the mock model and placeholder secrets, no step run; "
        "every problem is reported at once (a missing function, an import error, mock "
        "scripts for unknown agents, missing for known ones, or that their agents cannot "
        "parse). Exit codes: 0 ok, 2 problems found, 5 the sandbox could not run.",
    )
    p.add_argument(
        "payload",
        help="payload folder (holding manifest.toml), a program (a .py file, or a folder with "
        "__main__.py or main.py), or a shipped example's name",
    )
    p.add_argument(
        "--no-load",
        action="store_true",
        help="check the manifest and files only (no sandbox; faster, finds less)",
    )
    add_options(p, [option(name) for name in VALIDATE_OPTIONS])
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.set_defaults(handler=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from ..errors import OrchestratorError
    from ..payloads.manifest import load_manifest
    from .run import shadow_notice

    shadow_notice(args.payload)
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
    report["warnings"] = []
    prepared, code = prepare_check(args, manifest, report)
    missing = manifest.program is None and manifest.missing_function()  # from the source
    if missing:
        report["problems"].append(
            f"{manifest.path}: field `payload.entrypoint` {missing}. Fix the name, or define it."
        )
        code = 2
    elif prepared is not None and not args.no_load:
        code = max(code, load_check(prepared, report))
    report["ok"] = not report["problems"]
    if report["problems"]:  # whichever check found it: a problem is never exit 0
        code = max(code, 2)
    if args.json:
        print(json.dumps(report, indent=2))
        return code
    for problem in report["problems"]:
        say(problem, kind="problem")
    for warning in report["warnings"]:
        say(warning, kind="warning")
    if report["ok"]:
        loaded = f", agents {', '.join(report['agents'])}" if report.get("agents") else ""
        runs = (
            f"program {manifest.program}"
            if manifest.program
            else (f"entrypoint {manifest.entrypoint}")
        )
        print(
            f"{report['manifest']}: ok ({report['payload']}, {runs}, "
            f"{report['files']} files to ship{loaded})"
        )
    return code


def prepare_check(args: argparse.Namespace, manifest: Any, report: dict) -> tuple[Any, int]:
    """The checks `run` makes before it starts anything (`runner.prepare`, the one function),
    in check mode: the declared secrets must be set, but their values never leave the host.
    Returns the prepared check (None when refused) and the exit code so far; each problem is
    added to `report`. A dangerous import is reported and the other checks still made."""
    from dataclasses import replace

    from ..errors import OrchestratorError
    from ..lifecycle.runner import prepare
    from ..payloads.agentnames import known_scripts

    program = manifest.program is not None
    spec = spec_from_args(  # the flags of VALIDATE_OPTIONS, the user's default backend
        args,
        task=None if program else manifest.example_task or "(validation: no step runs)",
        # A program's own models are checked (routable, one endpoint, their key set); the
        # mock runs in their place, and no model is called.
        model=None if program else "mock",
        network="none",
        timeout_seconds=120,
        check_only=True,
    )
    code = 0
    for _ in range(2):
        try:
            prepared = prepare(spec)
        except OrchestratorError as exc:  # each said once (the second try may find it again)
            report["problems"] += [p for p in exc.problem_lines() if p not in report["problems"]]
            code = max(code, exc.exit_code)
            if spec.allow_dangerous_imports or exc.field != "payload":
                return None, code
            spec = replace(spec, allow_dangerous_imports=True)  # the other checks still run
            continue
        # A mock script for no agent, as `run` refuses it before any sandbox; the load then
        # checks the other scripts (every problem at once, each said once).
        scripts, error = known_scripts(prepared.manifest, prepared.files, prepared.model.provider)
        if error is not None:
            report["problems"] += error.problem_lines()
            code = max(code, error.exit_code)
            prepared = replace(prepared, manifest=replace(prepared.manifest, mock_scripts=scripts))
        return prepared, code
    return None, code


def load_check(prepared: Any, report: dict) -> int:
    """Load the payload's tree in a sandbox (mock model, no step); fill `report`; exit code."""
    from ..backends import get_backend
    from ..lifecycle.runner import execute, observers_of
    from ..spec import PAYLOAD_ERROR

    backend = get_backend(prepared.backend, env_file=prepared.spec.env_file)
    result = execute(prepared, backend=backend, observers=observers_of())
    report["check_run"] = result.run_id
    if result.status == "succeeded":
        report["agents"] = (result.answer or {}).get("agents", [])
        return 0
    error = result.error
    if error is not None and error.type == PAYLOAD_ERROR:
        report["problems"] += list(error.problems or (error.message,))
        return 2
    message = error.message if error is not None else None
    report["problems"].append(
        f"the payload could not be loaded in a sandbox ({result.status}: {message})"
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
        "--backend",
        default=DEFAULT_BACKEND,
        choices=backend_names(),
        help=f"whose leftovers to remove: {backends_help()}",
    )
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
    from ..lifecycle.cleanup import cleanup

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
