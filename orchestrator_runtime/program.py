"""Running a program as its author wrote it: a script run as `__main__`, its agents held.

A payload hands the runtime a function that builds the manager; a program builds its models
and agents whenever it likes and calls `agent.run(...)` itself. So the hold comes first, at
class level, before the program exists (`Program.install`): every `MultiStepAgent.run` goes
through `Program.run_agent`, which, for a top-level run (no agent of ours running), takes
control of the agent's whole tree (executors, step caps, events: `agents.take_control`),
sends each of its models where the run says (`route_model`), reports the tree (`run_start`
the first time, `agent_run` after) and keeps the answer. A managed agent's run is its
caller's business and passes straight through (its call is recorded by `Recorder`).

Standard library and smolagents only: this module runs inside the sandbox.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from smolagents.agents import MultiStepAgent
from smolagents.memory import FinalAnswerStep
from smolagents.models import Model

from .agents import (
    MODEL_NOTE,
    TOP_LEVEL_NAME,
    AgentNode,
    Recorder,
    describe,
    take_control,
    walk,
)
from .models import ScriptedModel, keep_tool_calls
from .protocol import AWS_REGION_ENV, ROUTABLE_MODELS
from .request import Request

#: The environment variable holding the task the host gave a program (a batch's task).
TASK_ENV = "ORCHESTRATOR_TASK"
#: Set on a model once its calls go where the run says (so it is routed once).
ROUTED = "orchestrator_routed"
#: A Bedrock client's arguments that carry credentials: the run's own (in the environment)
#: sign in their place.
AWS_CREDENTIAL_ARGS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")


class ProgramError(Exception):
    """The program cannot run here (its Python, a model that cannot be routed)."""


class Refused(BaseException):
    """A model the program made cannot be routed (`cause`): raised through the program's
    code as a BaseException, so that its `except Exception` cannot swallow the refusal."""

    def __init__(self, cause: ProgramError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class CheckDone(BaseException):
    """`check_only`: the program reached its first agent run, whose tree is now checked.
    A BaseException, so that a program's `except Exception` does not swallow it."""


class Program:
    """One program's run: the hold on smolagents, the agents it ran, its answer."""

    def __init__(
        self,
        request: Request,
        recorder: Recorder,
        emit_start: Callable[..., None],
        run_model: Model | None,
        problems: Callable[[list[AgentNode]], list[str]] | None = None,
    ) -> None:
        self.request = request
        #: What is wrong with the agents held so far (`Run.tree_problems`): a run refuses to
        #: start a step with any, as `validate` does.
        self.problems = problems
        self.recorder = recorder
        self.emit_start = emit_start
        #: The run's model (`model.source` "run", not mock): it replaces every model.
        self.run_model = run_model
        self.started = False  # run_start emitted
        self.nodes: list[AgentNode] = []  # every agent taken under control, in order
        self.top_level: list[MultiStepAgent] = []  # the program's top-level agents, in order
        self.answer: Any = None
        self.task_given = bool(request.task.strip())

    # The hold -----------------------------------------------------------------------------

    def install(self) -> None:
        """Route every agent run through `run_agent` (before the program imports smolagents:
        the program's `from smolagents import CodeAgent` finds the patched class)."""
        original_run = MultiStepAgent.run
        program = self

        def held_run(agent: MultiStepAgent, task: str, *args: Any, **kwargs: Any) -> Any:
            return program.run_agent(original_run, agent, task, *args, **kwargs)

        held_run.__doc__ = original_run.__doc__
        MultiStepAgent.run = held_run

    def run_agent(
        self, original: Any, agent: MultiStepAgent, task: str, *args: Any, **kwargs: Any
    ) -> Any:
        """An agent's run: straight through for a managed agent (its caller is running),
        else the program's top-level run, held."""
        if self.recorder.running:
            return original(agent, task, *args, **kwargs)
        options = dict(
            zip(
                ("stream", "reset", "images", "additional_args", "max_steps", "return_full_result"),
                args,
                strict=False,
            )
        )
        options.update(kwargs)
        first = not self.top_level
        self.take(agent)
        if self.request.check_only or (self.problems and self.problems(self.nodes)):
            raise CheckDone  # `validate` ends here; a run with problems is refused here
        own_task = task
        if first and self.task_given:  # a batch's task replaces the program's own
            task = self.request.task
        if first and self.request.additional_args and not options.get("additional_args"):
            options["additional_args"] = self.request.additional_args
        # The cap holds for a run's own max_steps too (`run(..., max_steps=1000)`).
        options["max_steps"] = min(options.get("max_steps") or agent.max_steps, agent.max_steps)
        full = options.pop("return_full_result", None)
        full = agent.return_full_result if full is None else full
        name = self.recorder.names[id(agent)]
        replaced = {"program_task": own_task} if task != own_task else {}
        self.recorder.events.emit("agent_run", agent=name, task=task, first=first, **replaced)
        if options.get("stream"):
            return self._streamed(original(agent, task, **options), agent, name)
        self.recorder.running = [agent]
        try:
            result = original(agent, task, return_full_result=True, **options)
        finally:
            self.recorder.running = []
        self._ended(name, result.output, result.state)
        return result if full else result.output

    def _streamed(self, steps: Iterator[Any], agent: MultiStepAgent, name: str) -> Iterator[Any]:
        """A streamed top-level run: its steps passed on, its final answer kept."""
        self.recorder.running = [agent]
        output, state = None, "max_steps_error"
        try:
            for step in steps:
                if isinstance(step, FinalAnswerStep):
                    output, state = step.output, "success"
                yield step
        finally:
            self.recorder.running = []
        self._ended(name, output, state)

    def _ended(self, name: str, output: Any, state: str) -> None:
        self.answer = output
        self.recorder.events.emit("final_answer", agent=name, answer=output, state=state)

    # Control ------------------------------------------------------------------------------

    def take(self, agent: MultiStepAgent) -> None:
        """Take control of a top-level agent's tree (the parts not held yet), route its
        models, and say what the tree is."""
        if agent not in self.top_level:
            self.top_level.append(agent)
        if not agent.name:  # the top level is `manager`, as in payloads; later ones numbered
            count = sum(1 for a in self.top_level if a is not agent and a.name is None)
            agent.name = TOP_LEVEL_NAME if not count else f"{TOP_LEVEL_NAME}_{count + 1}"
        held = {id(node.agent) for node in self.nodes}
        nodes = [node for node in walk(agent) if id(node.agent) not in held]
        if nodes:
            self.control(nodes)
            self.nodes += nodes
        tree = [describe(node) for node in walk_known(agent, self.nodes)]
        if not self.started:
            self.started = True
            self.emit_start(tree)
        else:
            self.recorder.events.emit("agent_tree", agent=agent.name, agents=tree)

    def control(self, nodes: list[AgentNode]) -> None:
        request = self.request
        mock = request.model_source == "run" and request.provider == "mock"
        chosen = {id(node.agent): node.agent.model for node in nodes}  # before any is replaced
        if not mock:
            for node in nodes:
                self.route(node)
        take_control(
            nodes,
            self.recorder,
            request.authorized_imports,
            request.max_steps,
            request.mock_scripts if mock else None,
            request.model_id,
            request.max_steps_from,
            keep_running=True,
        )
        if mock:  # each agent now plays its script
            for node in nodes:
                note(node.agent.model, "mock", chosen[id(node.agent)])

    def route(self, node: AgentNode) -> None:
        """Send the agent's model where the run says: the run's model in its place
        (`model.source` run), else the program's own to the run's endpoint."""
        agent = node.agent
        if self.run_model is not None:
            program_model = agent.model
            agent.model = self.run_model
            agent.monitor.tracked_model = agent.model
            note(agent.model, "run", program_model)
            return
        try:
            route_model(agent.model, self.request)
        except ProgramError as exc:
            raise Refused(exc) from None

    # Running ------------------------------------------------------------------------------

    def execute(self, root: Path) -> tuple[str, dict[str, Any] | None, BaseException | None]:
        """Run the program as `__main__` from `root`; its end as (state, error, the
        exception that ended it). Raises ProgramError when it cannot run here."""
        request = self.request
        assert request.program is not None
        check_python(request.requires_python)
        path = root / request.program
        sys.argv = [request.program, *request.argv]
        sys.path.insert(0, str(path.parent))
        os.chdir(path.parent)
        if self.task_given:
            os.environ[TASK_ENV] = request.task
        for name in request.endpoint_env:  # a client reading its endpoint finds the run's
            os.environ[name] = request.api_base or ""
        try:
            runpy.run_path(str(path), run_name="__main__")
        except CheckDone:
            return "checked", None, None
        except Refused as exc:
            return "refused", None, exc
        except SystemExit as exc:
            return (*exit_state(exc), None)
        except BaseException as exc:  # the program's own failure: its traceback, as Python
            traceback.print_exc()
            return "error", program_error(exc), exc
        finally:
            flush()
        return "success", None, None


def walk_known(agent: MultiStepAgent, nodes: list[AgentNode]) -> list[AgentNode]:
    """The tree under `agent` as the held nodes (with their names and sources)."""
    by_id = {id(node.agent): node for node in nodes}
    return [by_id.get(id(node.agent), node) for node in walk(agent)]


def route_model(model: Model, request: Request) -> None:
    """Send a program's model's calls to `request.api_base` (the run's gateway) with the
    run's credential, through the model's own client: its class, model id, provider and
    protocol stay (LiteLLM still speaks Anthropic's messages to an Anthropic model; Azure's
    client its deployments). Nothing to do without an api_base (the model then reaches its
    own endpoint, the run's network permitting).
    Raises ProgramError for a model class that cannot be routed."""
    if getattr(model, ROUTED, False) or isinstance(model, ScriptedModel):
        return
    mro = [c.__name__ for c in type(model).__mro__]
    kind = next((name for name in ROUTABLE_MODELS if name in mro), None)
    provider = getattr(model, "client_kwargs", {}).get("provider") if kind else None
    if kind is None:
        if not request.api_base:
            note(model, "program", model)
            return
        raise ProgramError(
            f"the program's model class {type(model).__name__} cannot be routed through the "
            f"run's model gateway (only {', '.join(ROUTABLE_MODELS)} can): its key would "
            "have to be in the sandbox. Use one of those, or replace every model with "
            "--model provider:model_id"
        )
    info = note(model, "program", model, provider=provider)
    if not request.api_base:
        return
    key = os.environ.get(request.credential_env or "") or "unused"
    if request.options:
        model.kwargs = {**getattr(model, "kwargs", {}), **request.options}
    if kind == "LiteLLMModel":  # LiteLLM reads both at each call
        model.api_base, model.api_key = request.api_base, key
    elif kind == "InferenceClientModel":
        _route_inference_client(model, request, key, provider)
    elif kind.startswith("AmazonBedrock"):  # boto3's client signs: made again
        _route_bedrock(model, request)
    else:  # OpenAI's client, or Azure's (same SDK, its endpoint named azure_endpoint)
        endpoint = "azure_endpoint" if kind.startswith("Azure") else "base_url"
        client_kwargs = {**model.client_kwargs, endpoint: request.api_base, "api_key": key}
        client_kwargs.pop("azure_ad_token", None)  # the key goes as `api-key` to the gateway
        model.client_kwargs = client_kwargs
        model.client = model.create_client()
    setattr(model, ROUTED, True)
    info["routed_to"] = "gateway" if request.credential_env else "api_base"


def _route_bedrock(model: Model, request: Request) -> None:
    """Bedrock's boto3 client, made again with the run's gateway as its endpoint, signing
    with the run's own AWS credentials (the environment's) for the run's region; whatever
    client or credentials the program gave it are dropped."""
    client_kwargs = {k: v for k, v in model.client_kwargs.items() if k not in AWS_CREDENTIAL_ARGS}
    client_kwargs["endpoint_url"] = request.api_base
    region = os.environ.get(AWS_REGION_ENV[0])
    if region:  # the run's, which the gateway checks signatures for
        client_kwargs["region_name"] = region
    model.client_kwargs = client_kwargs
    model.client = model.create_client()
    keep_tool_calls(model.client)


def _route_inference_client(model: Model, request: Request, key: str, provider: Any) -> None:
    """Hugging Face's router speaks OpenAI's protocol, and huggingface_hub's client cannot
    take both a base URL and a model id: its calls go through an OpenAI client."""
    from smolagents.models import OpenAIServerModel

    model_id = model.model_id or ""
    if provider not in (None, "auto"):
        model_id = f"{model_id}:{provider}"  # how Hugging Face's router picks a provider
    delegate = OpenAIServerModel(
        model_id,
        api_base=request.api_base,
        api_key=key,
        custom_role_conversions=getattr(model, "custom_role_conversions", None),
        flatten_messages_as_text=getattr(model, "flatten_messages_as_text", False),
        **getattr(model, "kwargs", {}),
    )
    model.client = delegate.client
    model.generate = delegate.generate
    model.generate_stream = delegate.generate_stream


def note(model: Any, source: str, chosen: Any, provider: str | None = None) -> dict[str, Any]:
    """Keep on `model` what the record says of it: the class and model id the program chose
    and whose model runs (`program`, `run`: an override, `mock`)."""
    info = {
        "class": type(chosen).__name__,
        "model_id": getattr(chosen, "model_id", None),
        "source": source,
    }
    if provider:
        info["provider"] = provider
    if chosen is not model:
        info["runs"] = type(model).__name__
    try:
        setattr(model, MODEL_NOTE, info)
    except AttributeError:  # a model with __slots__: the record goes without
        pass
    return info


def check_python(requires: str | None) -> None:
    """Refuse to run under an interpreter outside the program's `requires-python`."""
    if not requires:
        return
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    version = ".".join(str(part) for part in sys.version_info[:3])
    try:
        allowed = SpecifierSet(requires)
    except InvalidSpecifier as exc:
        raise ProgramError(f"requires-python {requires!r} is not a version specifier") from exc
    if version not in allowed:
        raise ProgramError(
            f"the program requires Python {requires}, and the sandbox's image has {version}. "
            "Build the image on a base with a matching Python (--base-image), or widen "
            "requires-python"
        )


def exit_state(exc: SystemExit) -> tuple[str, dict[str, Any] | None]:
    """`sys.exit(...)`: 0 or None is a normal end; a number is the exit code; anything
    else is printed (as Python does) and is exit code 1."""
    code = exc.code
    if code is None or code == 0:
        return "success", None
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        message, code = f"the program exited: {code}", 1
    else:
        message = f"the program exited with code {code}"
    return "error", {"type": "SystemExit", "message": message, "kind": "program", "exit_code": code}


def program_error(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(getattr(exc, "message", exc)),
        "kind": "program",
        "exit_code": 1,
    }


def flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a program may have replaced or closed them
            pass
