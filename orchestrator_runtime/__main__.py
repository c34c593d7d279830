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

import base64
import contextlib
import gc
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from .deadline import KEEPER_FD_ENV
from .events import EventStream, write_result
from .masking import Masker
from .protocol import POOLED_ENV, PRELOAD_TRACES, PRELOADABLE, READY_LINE
from .relay import Relay, make_undumpable
from .request import Request, RequestError, load_json, parse_request, secrets_of

EXIT_SUCCESS, EXIT_AGENT_FAILED, EXIT_BAD_REQUEST, EXIT_INTERNAL = 0, 1, 2, 3
#: What `--preload traces` imports: the runtime's tracing (OpenTelemetry, the instrumentation).
TRACING_MODULE = "orchestrator_runtime.tracing"


class PayloadError(Exception):
    """The payload's files could not be written, imported or turned into an agent."""


def isolate_stdout() -> int:
    """Keep a private copy of fd 1 for events; send fd 1 and sys.stdout to stderr.

    Then nothing but the runtime can write to the event stream: not print(), not a library,
    not C code writing to fd 1, not a child process.
    """
    events_fd = os.dup(1)  # not inheritable: child processes never get it
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return events_fd


def write_payload(root: Path, files: dict[str, Any]) -> None:
    """Write the payload under `root` (a fresh temporary directory), first on sys.path.

    Each file is text (UTF-8) or {"base64": ...} for bytes that are not (docs/PROTOCOL.md)."""
    for name, content in files.items():
        target = (root / name).resolve()
        if not name or "\\" in name or "\0" in name or root not in target.parents:
            raise PayloadError(f"payload file name {name!r} points outside the payload folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            target.write_bytes(content.encode("utf-8"))
        else:
            try:
                target.write_bytes(base64.b64decode(content["base64"], validate=True))
            except ValueError as exc:
                raise PayloadError(f"payload file {name!r} is not valid base64") from exc
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()


def load_manager(entrypoint: str, root: Path, model: Any) -> Any:
    """Import `module:function` from the payload and call it with the model."""
    from smolagents.agents import MultiStepAgent

    module_name, function_name = entrypoint.split(":")
    loaded = sys.modules.get(module_name.split(".")[0])
    if loaded is not None and root not in Path(getattr(loaded, "__file__", None) or "/").parents:
        raise PayloadError(f"payload module {module_name!r} would shadow the installed module")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise missing_module(exc, root) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise PayloadError(
            f"entrypoint {entrypoint!r}: {module_name} has no function {function_name}"
        )
    manager = function(model)
    if not isinstance(manager, MultiStepAgent):
        raise PayloadError(
            f"entrypoint {entrypoint!r} returned {type(manager).__name__}, not a smolagents agent"
        )
    return manager


def missing_module(exc: ModuleNotFoundError, root: Path) -> Exception:
    """A payload's import of a module the image does not have, said with where it is and what
    to do (the image is built from the manifest's requirements); `exc` itself when the
    missing module is the payload's own (its message then says it all)."""
    own = exc.name is not None and (root / exc.name.split(".")[0]).with_suffix(".py").exists()
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).is_relative_to(root)
    ]
    if own or exc.name is None or not frames:
        return exc
    where = f"{Path(frames[-1].filename).relative_to(root)}, line {frames[-1].lineno}"
    package = exc.name.split(".")[0]
    return PayloadError(
        f"{where}: `import {exc.name}`, but the sandbox's image has no module {package!r}. "
        f"Add its package to `[python] requirements` in manifest.toml (the image is built "
        f"with them), or remove the import"
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
        try:
            from .models import build_model

            model = build_model(request)
        except Exception as exc:
            return self.fail("model", exc, "internal", EXIT_INTERNAL)

        root = Path(tempfile.mkdtemp(prefix="orchestrator-payload-")).resolve()
        try:
            return self.load_and_run(request, root, model)
        finally:
            os.chdir("/")
            shutil.rmtree(root, ignore_errors=True)

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

        self.events.emit(
            "run_start",
            payload=request.payload_name,
            model={"provider": request.provider, "model_id": request.model_id},
            agents=[describe(node) for node in nodes],
            python=sys.version.split()[0],
            smolagents=sys.modules["smolagents"].__version__,
        )
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
        refuses to start its first step with any (the same check, one function)."""
        from .agents import not_granted

        names = [node.name for node in nodes]
        problems = [
            f"agent {node.name!r} declares additional_authorized_imports "
            f"{', '.join(missing)} that the manifest does not grant, so its code would fail "
            "to import them. Add them to `python.authorized_imports` in manifest.toml (the "
            "manifest is the ceiling of what agent code may import), or remove them from the "
            "agent."
            for node in nodes
            if (missing := not_granted(node.agent))
        ]
        problems += [
            f"mock script for {name!r}, which is not an agent of the tree (agents: "
            f"{', '.join(names)})"
            for name in sorted(set(request.mock_scripts) - set(names))
        ]
        if request.mock_scripts:
            from .models import script_problems

            problems += [
                f"no mock script for agent {name!r}" for name in names
                if name not in request.mock_scripts
            ]  # fmt: skip
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


def start_deadline() -> None:
    """Tell the keeper (pooled sandboxes only) that the run has begun: its deadline becomes
    the run's. One byte, once; the pipe is closed before any payload code exists."""
    fd_text = os.environ.pop(KEEPER_FD_ENV, None)
    if fd_text is None:
        return
    try:
        fd = int(fd_text)
    except ValueError:
        return
    try:
        os.write(fd, b"1")
    except OSError:
        pass  # the keeper keeps its idle deadline, which is earlier
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """Read the request, then run it in a child process whose events this one relays
    (relay.py): the payload never holds the host's event channel."""
    events_fd = isolate_stdout()
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
