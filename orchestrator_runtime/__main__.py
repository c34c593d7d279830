"""`python -m orchestrator_runtime [--request PATH]`: one request (stdin, or a file), one run,
events on stdout.

The life of a run, top to bottom: isolate stdout -> import smolagents and the runtime's own
modules (so a pooled sandbox is ready before its request comes) -> read the request -> tell
the deadline keeper the run has begun (pooled sandboxes) -> fork: this process
relays and checks the child's events (relay.py), the child does the rest -> secrets into the
environment -> patch smolagents -> write and import the payload -> take control of every
agent -> run the manager -> run_end (also to result_path). Exit codes: 0 final answer,
1 the agent failed, 2 bad request or payload, 3 internal error.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import importlib
import io
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from .deadline import KEEPER_FD_ENV
from .events import EventStream, write_result
from .idle import await_restore, start_deadline
from .masking import Masker
from .payload import PayloadError, load_manager, payload_root, write_payload
from .protocol import (
    POOLED_ENV,
    PRELOAD_TRACES,
    PRELOADABLE,
    READY_LINE,
    unknown_script_problem,
)
from .relay import Relay, make_undumpable
from .request import Request, RequestError, load_json, parse_request, secrets_of

EXIT_SUCCESS, EXIT_AGENT_FAILED, EXIT_BAD_REQUEST, EXIT_INTERNAL = 0, 1, 2, 3
#: What `--preload traces` imports: the runtime's tracing (OpenTelemetry, the instrumentation).
TRACING_MODULE = "orchestrator_runtime.tracing"


def isolate_stdout() -> int:
    """Keep a private copy of fd 1 for events; send fd 1 and sys.stdout to stderr.

    Then nothing but the runtime can write to the event stream: not print(), not a library,
    not C code writing to fd 1, not a child process.
    """
    events_fd = os.dup(1)  # not inheritable: child processes never get it
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr = stderr_that_writes_everything()
    return events_fd


def stderr_that_writes_everything() -> io.TextIOWrapper:
    """sys.stderr over a BufferedWriter, line-buffered (Python's own default for stderr).

    The images set PYTHONUNBUFFERED, which puts sys.stderr straight over the file: a short
    write is then taken as done and the rest of the text is lost. Under gVisor a write to
    the container's stderr pipe takes at most 64 KiB, so one large `print` lost everything
    past it; a BufferedWriter writes the rest."""
    sys.stderr.flush()
    return io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding=sys.stderr.encoding,
        errors=sys.stderr.errors,
        line_buffering=True,
    )


def apply_rlimits(limits: dict[str, int]) -> None:
    """Lower this process's limits (inherited by whatever it starts); never raise them."""
    import resource

    for name, value in limits.items():
        which = getattr(resource, f"RLIMIT_{name.upper()}")
        _soft, hard = resource.getrlimit(which)
        capped = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (capped, capped))


class Run:
    """One run: owns the event stream, the totals and the exit code."""

    def __init__(self, events: EventStream, *, write_result_file: bool = True) -> None:
        self.events = events
        self.started = time.time()
        self.recorder: Any = None
        self.audit: Any = None
        self.result_path: str | None = None
        self.write_result_file = write_result_file
        self.tracing: Any = None  # tracing.Tracing when the request asks for spans

    def fail(self, stage: str, exc: BaseException, kind: str, exit_code: int) -> int:
        """Emit `error` then `run_end` (state error); return the exit code."""
        tb = ""
        if not isinstance(exc, RequestError | PayloadError):  # those messages say it all
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        message = str(getattr(exc, "message", exc))
        error = {"type": type(exc).__name__, "message": message}
        self.events.emit("error", stage=stage, error=error, traceback=tb)
        self.end("error", None, {**error, "kind": kind})
        return exit_code

    def end(self, state: str, answer: Any, error: dict[str, Any] | None) -> None:
        rec = self.recorder
        event = self.events.emit(
            "run_end",
            state=state,
            answer=answer,
            error=error,
            token_usage={
                "input_tokens": rec.input_tokens if rec else 0,
                "output_tokens": rec.output_tokens if rec else 0,
            },
            steps=rec.steps if rec else 0,
            duration=time.time() - self.started,
        )
        if self.write_result_file and self.result_path and event is not None:
            write_result(self.result_path, event)

    def execute(self, raw: bytes) -> int:
        try:
            data = load_json(raw)
            self.events.masker = Masker(secrets_of(data).values())
            if isinstance(data.get("run_id"), str):
                self.events.run_id = data["run_id"]
            if isinstance(data.get("result_path"), str):
                self.result_path = data["result_path"]
            parsed = parse_request(data)
            # The secrets named in secret_env join the others: the payload's tools and the
            # model (credential_env) find every secret in one place.
            request = replace(parsed, secrets=parsed.secret_values(), secret_env=[])
        except RequestError as exc:
            return self.fail("request", exc, "payload", EXIT_BAD_REQUEST)
        os.environ.update(request.secrets)
        os.environ.update(request.model_env)  # not secret: a Bedrock model's region
        if request.trust_ca:  # the intercepting proxy's CA, before any payload code
            from .trust import trust_ca

            try:
                trust_ca(request.trust_ca)
            except ValueError as exc:
                return self.fail("request", RequestError(str(exc)), "payload", EXIT_BAD_REQUEST)
        apply_rlimits(request.rlimits)
        if request.trace:
            self.tracing = start_tracing(self.events, request.trace)
        from .egress_audit import install as audit_egress

        # Reports attempts the network refuses in the sandbox (`allowlist`: direct ones;
        # `none`: every one), each with the agent and step that made it (set once known).
        self.audit = audit_egress(self.events, request.network)
        return self.run_payload(request)

    def run_payload(self, request: Request) -> int:
        from .agents import Recorder, install_patches

        self.recorder = Recorder(self.events)
        if self.audit is not None:
            self.audit.where = self.recorder.where
        install_patches(request.authorized_imports, self.recorder)
        if request.program is not None:
            return self.run_program(request)
        try:
            from .models import build_model

            model = build_model(request)
        except Exception as exc:
            return self.fail("model", exc, "internal", EXIT_INTERNAL)

        with payload_root() as root:
            return self.load_and_run(request, root, model)

    def run_program(self, request: Request) -> int:
        """A program run as `__main__` (program.py): its agents held whenever it makes them,
        its end the run's end."""
        from .models import build_model, is_model_unavailable
        from .program import Program, ProgramError, Refused

        run_model = None
        if request.model_source == "run" and request.provider != "mock":
            try:
                run_model = build_model(request)
            except Exception as exc:
                return self.fail("model", exc, "internal", EXIT_INTERNAL)
        program = Program(
            request,
            self.recorder,
            lambda agents: self.start(request, agents),
            run_model,
            problems=lambda nodes: self.tree_problems(nodes, request),
        )
        program.install()
        traced = self.tracing.under_host_root() if self.tracing else contextlib.nullcontext()
        try:
            with payload_root() as root:
                write_payload(root, request.files)
                with traced:  # the program's spans under the host's root span
                    state, error, ended_by = program.execute(root)
        except (PayloadError, ProgramError) as refused:
            return self.fail("payload", refused, "payload", EXIT_BAD_REQUEST)
        if isinstance(ended_by, Refused):
            return self.fail("payload", ended_by.cause, "payload", EXIT_BAD_REQUEST)
        if not program.started:  # the program ran no agent
            self.start(request, [])
        if state == "checked" or (request.check_only and state == "success"):
            return self.check(program.nodes, request)
        if state == "success":
            self.end("success", program.answer, None)
            return EXIT_SUCCESS
        assert error is not None
        if ended_by is not None and is_model_unavailable(ended_by):
            error["kind"] = "model_unavailable"
        tb = "".join(traceback.format_exception(ended_by)) if ended_by is not None else ""
        self.events.emit("error", stage="program", error=error, traceback=tb)
        self.end("error", program.answer, error)
        return EXIT_AGENT_FAILED

    def start(self, request: Request, agents: list[dict[str, Any]]) -> None:
        """`run_start`: the payload, the model, the tree of agents (a program's: at its
        first agent run, or none at its end)."""
        model = {"provider": request.provider, "model_id": request.model_id}
        program = {}
        if request.program is not None:  # whose models run: the program's own, or the run's
            model["source"] = request.model_source
            program = {"program": {"path": request.program, "argv": request.argv}}
        self.events.emit(
            "run_start",
            payload=request.payload_name,
            model=model,
            agents=agents,
            python=sys.version.split()[0],
            smolagents=sys.modules["smolagents"].__version__,
            **program,
        )

    def load_and_run(self, request: Request, root: Path, model: Any) -> int:
        from .agents import describe, take_control, walk

        try:
            write_payload(root, request.files)
            os.chdir(root)
            manager = load_manager(request.entrypoint, root, model)
            nodes = walk(manager)
            scripts = request.mock_scripts if request.provider == "mock" else None
            take_control(
                nodes,
                self.recorder,
                request.authorized_imports,
                request.max_steps,
                scripts,
                request.model_id,
                request.max_steps_from,
            )
        except Exception as exc:
            return self.fail("payload", exc, "payload", EXIT_BAD_REQUEST)

        self.start(request, [describe(node) for node in nodes])
        if request.check_only or self.tree_problems(nodes, request):
            return self.check(nodes, request)  # a run refuses what `validate` would, unstarted
        return self.run_agent(manager, nodes[0].name, request)

    def check(self, nodes: list[Any], request: Request) -> int:
        """`validate`: the tree loaded; report every problem at once (`tree_problems`)."""
        names = [node.name for node in nodes]
        problems = self.tree_problems(nodes, request)
        if not problems:
            self.end("success", {"agents": names}, None)
            return EXIT_SUCCESS
        error = {"type": "PayloadError", "message": "; ".join(problems), "kind": "payload"}
        self.end("error", None, {**error, "problems": problems})
        return EXIT_BAD_REQUEST

    def tree_problems(self, nodes: list[Any], request: Request) -> list[str]:
        """What is wrong with a loaded tree, every problem at once: imports an agent declares
        and the run does not grant, and the mock scripts. `validate` reports them; a run
        refuses to start its first step with any (the same check, one function). A
        program's tree is what it has made so far: a script for an agent not made yet is a
        problem only when its name looks like a known agent's, misspelled."""
        from .agents import not_granted

        names = [node.name for node in nodes]
        grant = (
            "`authorized_imports` under `[tool.orchestrator.python]` in the program's "
            "`# /// script` block (the run's ceiling"
            if request.program is not None
            else "`python.authorized_imports` in manifest.toml (the manifest is the ceiling"
        )
        problems = [
            f"agent {node.name!r} declares additional_authorized_imports "
            f"{', '.join(missing)} that the run does not grant, so its code would fail to "
            f"import them. Add them to {grant} of what agent code may import), or remove them "
            "from the agent."
            for node in nodes
            if (missing := not_granted(node.agent))
        ]
        unknown = sorted(set(request.mock_scripts) - set(names))
        if request.program is not None:  # agents it makes later may have scripts too
            unknown = [n for n in unknown if difflib.get_close_matches(n, names, n=1)]
        problems += [unknown_script_problem(name, names) for name in unknown]
        if request.mock_scripts:
            from .models import script_problems

            problems += [
                f"no mock script for agent {name!r}"
                for name in names
                if name not in request.mock_scripts
            ]
            for node in nodes:
                outputs = request.mock_scripts.get(node.name) or []
                problems += script_problems(node.name, node.agent, outputs, top=node.caller is None)
        return problems

    def run_agent(self, manager: Any, name: str, request: Request) -> int:
        from smolagents.utils import AgentGenerationError, AgentMaxStepsError

        from .models import is_model_unavailable

        traced = self.tracing.under_host_root() if self.tracing else contextlib.nullcontext()
        try:
            with traced:
                result = manager.run(
                    request.task,
                    additional_args=request.additional_args,
                    max_steps=manager.max_steps,  # take_control's: the program's or the cap
                    return_full_result=True,
                )
        except (Exception, SystemExit) as exc:
            kind = "model_unavailable" if is_model_unavailable(exc) else "agent"
            stage = "model" if isinstance(exc, AgentGenerationError) or kind != "agent" else "run"
            return self.fail(stage, exc, kind, EXIT_AGENT_FAILED)
        if result.state == "success":
            self.events.emit("final_answer", agent=name, answer=result.output)
            self.end("success", result.output, None)
            return EXIT_SUCCESS
        last = manager.memory.steps[-1] if manager.memory.steps else None
        failure = getattr(last, "error", None) or AgentMaxStepsError(
            "Reached max steps.", manager.logger
        )
        error = {"type": type(failure).__name__, "message": str(failure), "kind": "agent"}
        self.end("max_steps_error", result.output, error)
        return EXIT_AGENT_FAILED


def start_tracing(events: EventStream, trace: dict[str, str]) -> Any:
    """The run's spans on the event channel (tracing.py); None, said on stderr, when this
    image cannot trace (the run goes on: its spans are an extra, never its outcome)."""
    try:
        from .tracing import Tracing

        return Tracing(events, trace["trace_id"], trace["parent_span_id"])
    except Exception as exc:
        print(f"orchestrator_runtime: no traces for this run: {exc!r}", file=sys.stderr)
        return None


def read_request(argv: list[str]) -> bytes:
    """The request: stdin (Docker), or a file given as `--request PATH` (E2B, which uploads
    it), deleted once read so that nothing the agent runs can find it there."""
    if len(argv) == 2 and argv[0] == "--request":
        path = Path(argv[1])
        try:
            return path.read_bytes()
        finally:
            path.unlink(missing_ok=True)
    if argv:
        raise RequestError(
            f"unexpected arguments {argv!r}: use [--preload MODULE] and no arguments or "
            "--request PATH"
        )
    return sys.stdin.buffer.read()


def split_preload(argv: list[str]) -> tuple[list[str], list[str]]:
    """The `--preload NAME` options (each one of PRELOADABLE, first on the command line) and
    the rest."""
    names = []
    while len(argv) >= 2 and argv[0] == "--preload" and argv[1] in PRELOADABLE:
        names.append(argv[1])
        argv = argv[2:]
    return names, argv


def preload(names: list[str] | None = None) -> None:
    """Import what every run needs before the request comes, and what the host named (the
    model's client library; `traces`: tracing.py): a pooled sandbox has paid for it while it
    idled, and a cold one overlaps it with the host's shipping of the request. Nothing here
    reads the request, the environment's secrets (there are none yet) or writes to stdout."""
    # The garbage collector is off while they load: thousands of objects that live as long
    # as the process, whose collections cost about 5% of the import. gc.freeze keeps them
    # out of every later collection (and leaves their pages shared with the forked child).
    gc.disable()
    try:
        import smolagents  # noqa: F401 - the import is the point

        from . import agents, egress_audit, models  # noqa: F401

        for name in names or ():
            with contextlib.suppress(ImportError):  # not in this image: the run says so
                importlib.import_module(TRACING_MODULE if name == PRELOAD_TRACES else name)
    finally:
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    """Read the request, then run it in a child process whose events this one relays
    (relay.py): the payload never holds the host's event channel."""
    events_fd = isolate_stdout()
    # LiteLLM fetches its model price table from the internet at import unless told not to:
    # in a sandbox that cannot reach it, seconds of retries before a program's first step.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    names, argv = split_preload(sys.argv[1:] if argv is None else argv)
    try:
        preload(names)
    except Exception:  # the child reports it properly when it imports them again
        traceback.print_exc()
    pooled = os.environ.pop(POOLED_ENV, None) == "1"
    if pooled or KEEPER_FD_ENV in os.environ:  # a pooled sandbox: tell the pool it is ready
        sys.stderr.write(READY_LINE)
        sys.stderr.flush()
    try:
        await_restore()  # a snapshot's runtime is checkpointed here
        raw = read_request(argv)
    except (OSError, RequestError) as exc:
        start_deadline()
        return Run(EventStream(events_fd)).fail("request", exc, "payload", EXIT_BAD_REQUEST)
    start_deadline()
    run_id, result_path = envelope_of(raw)
    source, sink = os.pipe()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        os.close(source)
        os.close(events_fd)
        code = run_request(EventStream(sink), raw)
        sys.stderr.flush()
        os._exit(code)
    os.close(sink)
    make_undumpable()
    return Relay(source, events_fd, run_id, result_path).run(child)


def run_request(events: EventStream, raw: bytes) -> int:
    """The child's whole life: one request, its events on `events`, an exit code."""
    run = Run(events, write_result_file=False)  # the relay writes result_path
    try:
        return run.execute(raw)
    except BaseException as exc:  # a bug of the runtime itself: still end the stream properly
        if events.closed:
            return EXIT_INTERNAL
        return run.fail("internal", exc, "internal", EXIT_INTERNAL)


def envelope_of(raw: bytes) -> tuple[str | None, str | None]:
    """The run id and result path of a request, for the relay's own events (best effort: a
    bad request is the child's to report)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    run_id, path = data.get("run_id"), data.get("result_path")
    return (run_id if isinstance(run_id, str) else None), (path if isinstance(path, str) else None)


def exit_now(code: int) -> None:
    """Flush and leave without the interpreter's shutdown (with smolagents loaded it takes a
    tenth of a second, and every run waits for this process's exit)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
