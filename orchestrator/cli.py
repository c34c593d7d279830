"""The `orchestrator` command: a thin layer over the Python API."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .errors import OrchestratorError
from .manifest import BACKENDS
from .models import PROVIDERS
from .runner import EXIT_CODES, RunCancelled, RunResult, RunSpec

EPILOG_EXIT = (
    "Exit codes: "
    + ", ".join(f"{c} {s}" for s, c in EXIT_CODES.items())
    + (", 2 bad input (nothing started).")
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except OrchestratorError as exc:
        print(f"error: {exc.cause}", file=sys.stderr)
        if exc.fix:
            print(f"  fix: {exc.fix}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrator",
        description="Run whole smolagents multi-agent programs in hardened sandboxes.",
        epilog=EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    add_run_parser(sub)
    add_images_parser(sub)
    add_runs_parser(sub)
    add_payload_parser(sub)
    add_cleanup_parser(sub)
    __import__("orchestrator.batch_cli").batch_cli.add_batch_parser(sub)
    __import__("orchestrator.schedule_cli").schedule_cli.add_schedule_parser(sub)
    return parser


# --- run ------------------------------------------------------------------------------------


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and the commands built on it (batch, schedules)."""
    providers = "; ".join(f"{name}: {p.summary}" for name, p in PROVIDERS.items())
    p.add_argument(
        "--model", default="mock", help=f"provider[:model_id] ({providers}). Default: mock"
    )
    p.add_argument("--api-base", help="model endpoint URL (OpenAI-compatible servers, LiteLLM)")
    p.add_argument("--model-key-env", help="environment variable holding the model's API key")
    p.add_argument(
        "--backend", choices=BACKENDS,
        help="where sandboxes run: docker (this host's engine) or e2b (E2B's cloud; needs "
        "E2B_API_KEY). Default: the payload's `payload.backend`, else docker",
    )  # fmt: skip
    p.add_argument(
        "--network", choices=["none", "allowlist", "open"],
        help="network policy: none (default for a mock model and no declared hosts), "
        "allowlist (default otherwise: the model's host, the payload's [network] hosts and "
        "--allow-host, through an egress proxy) or open (unrestricted; only when named)",
    )  # fmt: skip
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="extra host the sandbox may reach under allowlist (api.example.com or "
        "*.example.com; ports 80 and 443)",
    )
    p.add_argument("--max-steps", type=int, help="steps per agent (default: manifest, else 10)")
    p.add_argument(
        "--timeout",
        type=float,
        dest="timeout_seconds",
        help="wall-clock seconds (default: manifest, else 300)",
    )
    p.add_argument(
        "--memory",
        type=int,
        dest="memory_mb",
        help="memory limit in MiB (default: manifest, else 1024)",
    )
    p.add_argument("--cpus", type=float, help="CPU limit (default: manifest, else 1.0)")
    p.add_argument("--pids", type=int, help="process limit (default: manifest, else 256)")
    p.add_argument("--env-file", help="dotenv file to read secrets from (default: ./.env)")
    p.add_argument(
        "--i-understand-dangerous-imports", action="store_true", dest="allow_dangerous_imports",
        help="allow authorized_imports such as os or subprocess in the inner executor",
    )  # fmt: skip


def add_run_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a payload once in a fresh sandbox",
        description="Run a payload (a folder with manifest.toml) on a task in one fresh, "
        "hardened sandbox, stream its events, and keep a run record.",
        epilog="Example: orchestrator run agent_payloads/research_team --model mock\n"
        + EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("payload", help="payload folder (holding manifest.toml)")
    p.add_argument("task", nargs="?", help="the task (default: the manifest's example_task)")
    add_run_options(p)
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="additional_args entry for the agent",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no live output")
    p.set_defaults(handler=cmd_run)


def spec_from_args(args: argparse.Namespace, **overrides: Any) -> RunSpec:
    fields = dict(
        payload=getattr(args, "payload", None),
        task=getattr(args, "task", None),
        model=args.model,
        api_base=args.api_base,
        model_key_env=args.model_key_env,
        backend=args.backend,
        network=args.network,
        allow_hosts=tuple(args.allow_host),
        max_steps=args.max_steps,
        timeout_seconds=args.timeout_seconds,
        memory_mb=args.memory_mb,
        cpus=args.cpus,
        pids=args.pids,
        env_file=args.env_file,
        allow_dangerous_imports=args.allow_dangerous_imports,
        additional_args=parse_kv_args(getattr(args, "arg", [])),
    )
    fields.update(overrides)
    return RunSpec(**fields)


def parse_kv_args(items: list[str]) -> dict[str, Any] | None:
    if not items:
        return None
    result: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise OrchestratorError(
                f"--arg {item!r} is not KEY=VALUE.", "Write --arg a=3 or --arg name='\"x\"'."
            )
        try:
            result[key] = json.loads(raw)
        except ValueError:
            result[key] = raw
    return result


def install_sigterm_handler() -> None:
    """SIGTERM tears a run down like Ctrl-C does (the sandbox is removed, status cancelled)."""

    def handler(signum: int, frame: Any) -> None:
        raise RunCancelled(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def cmd_run(args: argparse.Namespace) -> int:
    from .display import RunDisplay
    from .runner import run

    spec = spec_from_args(args)
    display = RunDisplay(quiet=args.quiet)
    install_sigterm_handler()
    try:
        result = run(spec, on_event=display.event, on_progress=display.progress)
    except (KeyboardInterrupt, RunCancelled):
        display.stop()
        print(
            "cancelled: the sandbox was removed and the run recorded as `cancelled`.",
            file=sys.stderr,
        )
        return EXIT_CODES["cancelled"]
    finally:
        display.stop()
    print_result(result, as_json=args.json)
    return result.cli_exit_code


def print_result(result: RunResult, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
        return
    print(
        f"run {result.run_id}: {result.status} in {result.timings.get('duration', 0):.1f}s",
        file=sys.stderr,
    )
    if result.error:
        print(
            f"  error: {result.error.get('type')}: {result.error.get('message')}", file=sys.stderr
        )
    print(f"  record: {result.record_dir}", file=sys.stderr)
    if result.status == "succeeded":
        answer = result.answer
        print(answer if isinstance(answer, str) else json.dumps(answer, default=str))


# --- images ---------------------------------------------------------------------------------


def add_images_parser(sub: Any) -> None:
    p = sub.add_parser("images", help="build, list and prune sandbox images")
    isub = p.add_subparsers(title="images commands", metavar="ACTION")
    b = isub.add_parser(
        "build",
        help="build (or reuse) the agent image, and a payload's derived image",
        description="Build the agent image (Docker) or template (E2B) if it does not exist yet; "
        "prints its tag or template name. Content-addressed: unchanged inputs never rebuild.",
    )
    b.add_argument("--payload", help="also build the derived image for this payload's requirements")
    b.add_argument(
        "--base",
        help="base image (docker default: $ORCHESTRATOR_BASE_IMAGE or python:3.12-slim; "
        "e2b default: $ORCHESTRATOR_E2B_BASE_IMAGE or python:3.12-slim)",
    )
    b.add_argument(
        "--backend", choices=BACKENDS, default="docker",
        help="docker: an image on this host's engine; e2b: an E2B template (needs E2B_API_KEY)",
    )  # fmt: skip
    b.set_defaults(handler=cmd_images_build)
    bb = isub.add_parser(
        "bootstrap-base",
        help="make a Debian base image with debootstrap + docker import (no registry needed)",
    )
    bb.add_argument("--suite", default="bookworm")
    bb.add_argument("--mirror", default="http://deb.debian.org/debian")
    bb.set_defaults(handler=cmd_images_bootstrap)
    ls = isub.add_parser("list", help="list orchestrator images")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=cmd_images_list)
    pr = isub.add_parser("prune", help="remove orchestrator images that are no longer current")
    pr.add_argument("--dry-run", action="store_true")
    pr.set_defaults(handler=cmd_images_prune)
    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])


def cmd_images_build(args: argparse.Namespace) -> int:
    from .backends.docker import connect
    from .display import RunDisplay
    from .images import ensure_agent_image
    from .manifest import load_manifest

    display = RunDisplay()
    extra: tuple[str, ...] = ()
    if args.payload:
        extra = load_manifest(args.payload).requirements
    if args.backend == "e2b":
        from dataclasses import replace

        from .backends.e2b import E2BSettings, ensure_template

        settings = E2BSettings.from_env()
        if args.base:
            settings = replace(settings, base_image=args.base)
        print(ensure_template(settings, extra, progress=display.progress))
        return 0
    tag = ensure_agent_image(
        connect(), base=args.base, extra_requirements=extra, progress=display.progress
    )
    print(tag)
    return 0


def cmd_images_bootstrap(args: argparse.Namespace) -> int:
    from .backends.docker import connect
    from .display import RunDisplay
    from .images import bootstrap_base

    display = RunDisplay()
    print(
        bootstrap_base(connect(), suite=args.suite, mirror=args.mirror, progress=display.progress)
    )
    return 0


def cmd_images_list(args: argparse.Namespace) -> int:
    from .backends.docker import connect
    from .images import list_images

    images = list_images(connect())
    if args.json:
        print(json.dumps(images, indent=2, default=str))
    else:
        for image in images:
            print("\t".join(str(image.get(k, "")) for k in ("tag", "kind", "created", "size")))
    return 0


def cmd_images_prune(args: argparse.Namespace) -> int:
    from .backends.docker import connect
    from .images import prune_images

    for tag in prune_images(connect(), dry_run=args.dry_run):
        print(("would remove " if args.dry_run else "removed ") + tag)
    return 0


# --- runs -----------------------------------------------------------------------------------


def add_runs_parser(sub: Any) -> None:
    p = sub.add_parser("runs", help="read run records")
    rsub = p.add_subparsers(title="runs commands", metavar="ACTION")
    ls = rsub.add_parser("list", help="recent runs, newest first")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--status", choices=[*EXIT_CODES])
    ls.add_argument("--schedule", help="only runs fired by this schedule")
    ls.add_argument("--batch", help="only runs of this batch")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=cmd_runs_list)
    show = rsub.add_parser("show", help="a run's result (id or unique prefix)")
    show.add_argument("run_id")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=cmd_runs_show)
    logs = rsub.add_parser("logs", help="a run's events and logs")
    logs.add_argument("run_id")
    logs.add_argument("--stream", choices=["events", "stderr", "stdout"], default="events")
    logs.add_argument("--json", action="store_true", help="raw JSON lines for events")
    logs.set_defaults(handler=cmd_runs_logs)
    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])


def _find_run(run_id: str) -> dict[str, Any]:
    from .store import Store

    row = Store().get_run(run_id)
    if row is None:
        raise OrchestratorError(
            f"No run {run_id!r} in this store.", "List runs with `orchestrator runs list`."
        )
    return row


def cmd_runs_list(args: argparse.Namespace) -> int:
    from .store import Store

    rows = Store().list_runs(
        limit=args.limit, status=args.status, schedule=args.schedule, batch=args.batch
    )
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["created_at"]))
        duration = f"{row['duration']:.1f}s" if row.get("duration") is not None else "-"
        status = f"{row['status']:<11}"
        print(f"{row['run_id']}  {created}  {status} {duration:>7}  {row['payload']}", row["model"])
    return 0


def cmd_runs_show(args: argparse.Namespace) -> int:
    from .store import Store

    row = _find_run(args.run_id)
    result = Store.read_result(row["record_dir"]) or row
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        for key in (
            "run_id",
            "status",
            "answer",
            "error",
            "payload",
            "model",
            "network",
            "record_dir",
        ):
            print(f"{key:>10}: {result.get(key)}")
    return 0


def cmd_runs_logs(args: argparse.Namespace) -> int:
    from .display import describe_event

    row = _find_run(args.run_id)
    name = {"events": "events.jsonl", "stderr": "stderr.log", "stdout": "stdout.log"}[args.stream]
    path = Path(row["record_dir"]) / name
    if not path.is_file():
        return 0
    for line in path.read_text().splitlines():
        if args.stream == "events" and not args.json:
            text = describe_event(json.loads(line))
            if text:
                print(text)
        else:
            print(line)
    return 0


# --- payloads and cleanup -------------------------------------------------------------------


def add_payload_parser(sub: Any) -> None:
    p = sub.add_parser("validate", help="validate a payload's manifest without running it")
    p.add_argument("payload")
    p.set_defaults(handler=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from .manifest import load_manifest

    manifest = load_manifest(args.payload)
    print(f"{manifest.path}: ok ({manifest.name}, entrypoint {manifest.entrypoint})")
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
    from .cleanup import cleanup
    from .runner import get_backend

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


if __name__ == "__main__":
    sys.exit(main())
