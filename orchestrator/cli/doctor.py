"""`orchestrator doctor`: the conformance kit's checks against this host and backend."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..registry import DEFAULT_BACKEND, backend_names, backends_help
from .output import say
from .parser import HELP

DESCRIPTION = """\
Check that this host and backend keep the orchestrator's promises, with the same checks a
backend must pass in the conformance kit (orchestrator.testing): the host's configuration
as the engine reports it (which kernel runs on `auto` pick: gVisor registered or not; the
seccomp filter; cgroup limits; no debug mode writing request bodies to the engine's log;
and, for speed only, whether gVisor runs start from snapshots and the storage driver),
then short real runs of a probe payload in sandboxes of the backend (one sandbox per run,
removed after; a cancel ending the run; a warm sandbox serving its one run; payloads with a
symlink out or over the size cap refused before any sandbox; time, memory, process and
output limits; a forged end not believed; not root, no capabilities, read-only root; no
engine socket; io_uring, ptrace and AF_VSOCK refused; under network `none` the host's
addresses, the metadata address and DNS out of reach; under `allowlist` only the listed
endpoint, refusals recorded; the model key absent and tokens measured by the gateway; a
sandbox stopping by itself when its orchestrator is SIGKILLed; cleanup of a dead run).

One line per check: PASS, FAIL (with what to do) or NOT APPLICABLE (with the capability
the backend declares absent). Its runs use a temporary state directory (your config file
and wheelhouse kept) and it removes every sandbox and network it made. A few minutes.

What it proves: that this configuration keeps those promises now. What it cannot: it is not
a penetration test; a passing check says the configured barrier is in place, not that the
barrier (gVisor, seccomp, the kernel, the engine) has no hole.

Exit codes: 0 every applicable check passed, 1 a check failed, 2 bad input, 5 the backend
could not be reached."""


def add_doctor_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help=HELP["doctor"],
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--backend",
        default=DEFAULT_BACKEND,
        choices=backend_names(),
        help=f"the backend to check: {backends_help()}",
    )
    p.add_argument(
        "--sandbox-runtime",
        metavar="NAME",
        help="the sandbox runtime the checks' runs ask for, one the backend offers (default: "
        "as your runs would: "
        "$ORCHESTRATOR_SANDBOX_RUNTIME, the config file, else auto)",
    )
    p.add_argument(
        "--check",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this check (repeatable); names as in the report",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(handler=cmd_doctor)


STATUS = {"pass": "PASS", "fail": "FAIL", "not_applicable": "NOT APPLICABLE"}


def line(outcome: Any) -> str:
    """One report line (and, for a FAIL, the fix on the next)."""
    text = f"{STATUS[outcome.status]:<15} {outcome.name:<30} {outcome.detail}"
    if outcome.status == "fail" and outcome.fix:
        text += f"\n{'':<15} fix: {outcome.fix}"
    return text


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..testing.doctor import check_names, doctor

    names = check_names(args.backend)
    unknown = [name for name in args.check if name not in names]
    if unknown:
        raise ConfigError(
            f"No check named {', '.join(unknown)} for the {args.backend} backend.",
            f"Use one of {', '.join(names)}.",
        )
    started = time.monotonic()

    def show(outcome: Any) -> None:
        if not args.json:
            print(line(outcome), flush=True)

    if not args.json:
        say(f"doctor: checking the {args.backend} backend on this host (a few minutes)")
    report = doctor(args.backend, runtime=args.sandbox_runtime, only=args.check, on_outcome=show)
    outcomes, ok = report.outcomes, report.passed
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUS}
    if args.json:
        data = {
            "backend": args.backend,
            "ok": ok,
            "counts": counts,
            "seconds": round(time.monotonic() - started, 1),
            "checks": [o.to_dict() for o in outcomes],
            "runs": report.run_ids,  # every one removed again; listed for an audit
        }
        print(json.dumps(data, indent=2))
    else:
        print(
            f"{len(outcomes)} checks: {counts['pass']} passed, {counts['fail']} failed, "
            f"{counts['not_applicable']} not applicable ({time.monotonic() - started:.0f} s)"
        )
    return 0 if ok else 1
