"""What every command shares: the run options, their mapping to a RunSpec, signals."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection, Iterator
from typing import Any

from ..defaults import fill
from ..errors import OrchestratorError
from ..models import PROVIDERS
from ..registry import backend_entry, backend_names, backends_help
from ..spec import EXIT_CODES, RunSpec

EPILOG_EXIT = (
    "Exit codes: "
    + ", ".join(f"{c} {s}" for s, c in EXIT_CODES.items())
    + (", 2 bad input (nothing started).")
)


class BackendNames(Collection[str]):
    """Every backend's name, read when asked: a built-in name is found in it without
    reading the entry points (`registry.backend_entry`)."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and backend_entry(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(backend_names())

    def __len__(self) -> int:
        return len(backend_names())


class BackendOption(argparse.Action):
    """`--backend NAME` of the run options: its choices and help name every backend when
    they are read (a name given, --help, completion, the reference), not when the parser is
    built, so a run that names no backend never reads the installed packages' entry points
    (`registry.backend_entries`, 15 ms of CPU) for it."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("metavar", "NAME")  # argparse would list the choices to check it
        super().__init__(option_strings, dest, **kwargs)

    @property
    def choices(self) -> BackendNames:
        return BackendNames()

    @choices.setter
    def choices(self, _value: Any) -> None:
        """Always the registry's (argparse sets None as it makes the action)."""

    @property
    def help(self) -> str:
        return (
            f"where sandboxes run: {backends_help()}. Default: $ORCHESTRATOR_BACKEND, the "
            "config file's backend, the payload's `payload.backend`, else docker"
        )

    @help.setter
    def help(self, _value: Any) -> None:
        """Always the text above (argparse sets None as it makes the action)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and the commands built on it (batch, schedules)."""
    _add_model_options(p)
    _add_sandbox_options(p)
    _add_limit_options(p)
    p.add_argument(
        "--no-gateway",
        action="store_false",
        dest="gateway",
        help="put the model key into the sandbox instead of serving the model through the "
        "run's gateway (default: a gateway for openai, hf and litellm models; a backend "
        "without one refuses them unless this is given; no host-measured tokens or budgets "
        "without it)",
    )
    p.add_argument(
        "--traces-to",
        metavar="URL",
        help="export each run's OpenTelemetry trace (the run, its agents' spans, its model "
        "calls) to this OTLP/HTTP collector, e.g. http://127.0.0.1:6006 (Phoenix); `off` for "
        "none. Default: OpenTelemetry's OTEL_EXPORTER_OTLP_ENDPOINT (and _HEADERS, "
        "_PROTOCOL) when set, else no traces",
    )
    p.add_argument("--env-file", help="dotenv file to read secrets from (default: ./.env)")
    p.add_argument(
        "--i-understand-dangerous-imports",
        action="store_true",
        dest="allow_dangerous_imports",
        help="allow authorized_imports such as os or subprocess in the inner executor",
    )


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """Which model, at which endpoint, with which key."""
    providers = "; ".join(f"{name}: {spec.summary}" for name, spec in PROVIDERS.items())
    p.add_argument(
        "--model",
        help=f"provider[:model_id] ({providers}). Default: $ORCHESTRATOR_MODEL, the config "
        "file's model, else mock",
    )
    p.add_argument("--api-base", help="model endpoint URL (OpenAI-compatible servers, LiteLLM)")
    p.add_argument("--model-key-env", help="environment variable holding the model's API key")


def _add_sandbox_options(p: argparse.ArgumentParser) -> None:
    """Where the sandbox runs, on which kernel, and what it may reach or install."""
    p.add_argument("--backend", action=BackendOption)
    p.add_argument(
        "--network",
        choices=["none", "allowlist", "open"],
        help="network policy: none (default for a mock model and no declared hosts), "
        "allowlist (default otherwise: the model's host, the payload's [network] hosts and "
        "--allow-host, through an egress proxy) or open (unrestricted; only when named); "
        "$ORCHESTRATOR_NETWORK or the config file's network come first when set",
    )
    p.add_argument(
        "--sandbox-runtime",
        metavar="RUNTIME",
        help="the sandbox's kernel: auto (default: the backend's best) or one the backend "
        "offers (refused otherwise, naming them); on docker: runsc (gVisor's; set it up with "
        "scripts/setup-gvisor.sh), runc (the host's, behind our seccomp profile), auto: runsc "
        "when the engine has it, else runc; $ORCHESTRATOR_SANDBOX_RUNTIME, the config file's "
        "sandbox_runtime, then the payload's `payload.sandbox_runtime` come first when set "
        "(e2b: only auto)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="extra host the sandbox may reach under allowlist (api.example.com or "
        "*.example.com; ports 80 and 443)",
    )
    p.add_argument(
        "--allow-requirement",
        action="append",
        default=[],
        metavar="REQ",
        dest="allowed_requirements",
        help="let the payload install exactly this requirement string although it is not a "
        "package specification, e.g. a `name @ file:///...` or `name @ https://...` reference "
        "(pip on this machine fetches or opens it); repeat for each",
    )


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    """The run's limits (each: the flag, else the manifest, else the default)."""
    p.add_argument(
        "--max-steps",
        type=int,
        help="steps of the top agent; its managed agents get at most as many (default: the "
        "manifest's [limits] max_steps, the same way; else each agent keeps the max_steps its "
        "program gave it, smolagents' default 20; `runs show` says what each had and why)",
    )
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
    p.add_argument(
        "--max-model-calls",
        type=int,
        metavar="N",
        help="model calls the run's gateway forwards; call N+1 ends the run with "
        "budget_exceeded (default: manifest, else 200)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="input + output tokens the run may spend, as the gateway measures them "
        "(default: manifest, else 2000000)",
    )


def spec_from_args(args: argparse.Namespace, **overrides: Any) -> RunSpec:
    fields = dict(
        payload=getattr(args, "payload", None),
        task=getattr(args, "task", None),
        model=args.model,
        api_base=args.api_base,
        model_key_env=args.model_key_env,
        backend=args.backend,
        network=args.network,
        sandbox_runtime=args.sandbox_runtime,
        allow_hosts=tuple(args.allow_host),
        allowed_requirements=tuple(args.allowed_requirements),
        max_steps=args.max_steps,
        timeout_seconds=args.timeout_seconds,
        memory_mb=args.memory_mb,
        cpus=args.cpus,
        pids=args.pids,
        max_model_calls=args.max_model_calls,
        max_tokens=args.max_tokens,
        gateway=args.gateway,
        traces_to=args.traces_to,
        env_file=args.env_file,
        allow_dangerous_imports=args.allow_dangerous_imports,
        additional_args=parse_kv_args(getattr(args, "arg", [])),
    )
    fields.update(overrides)
    fields.update(fill({k: fields[k] for k in ("model", "backend", "network")}))
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
        except ValueError as exc:
            if raw.lstrip()[:1] in ("[", "{", '"'):  # meant as JSON: never a silent string
                raise OrchestratorError(
                    f"--arg {key}: {raw!r} is not valid JSON ({exc}).",
                    f"Fix the JSON (e.g. --arg '{key}=[1, 2]'), or quote it whole to pass "
                    f"a string: --arg '{key}=\"...\"'.",
                ) from None
            result[key] = raw  # a bare word is a string: --arg name=alice
    return result


def tidy_store() -> None:
    """Close runs whose orchestrator process died (see `cleanup.tidy`), saying so on stderr:
    every command that opens the store does this first."""
    from ..lifecycle.cleanup import closed_line, tidy

    def warn(message: str) -> None:
        print(f"orchestrator: warning: {message}", file=sys.stderr)

    for run_id in tidy(warn=warn):
        print(f"orchestrator: {closed_line(run_id)}", file=sys.stderr)
