"""Taking control of the payload's agents: executors, step caps, scripted models, events.

smolagents wires a multi-agent program like this (1.26):
- `CodeAgent.__init__` ends with `self.python_executor = executor or self.create_python_executor()`;
  a non-local `executor_type` builds a remote executor there, and refuses managed agents.
- `MultiStepAgent.run` sends `{**tools, **managed_agents}` to the executor at every run, so
  a replaced executor still gets the tools and the managed agents (callable objects).
- A managed agent is called as `agent(task=..., additional_args=...)`, i.e. `__call__`, from
  inside its caller's executor (CodeAgent) or `execute_tool_call` (ToolCallingAgent).
- `agent.step_callbacks` (a CallbackRegistry) is called by `_finalize_step` for each
  ActionStep/PlanningStep, also when the model call failed (then from a `finally` block).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from smolagents.agents import CodeAgent, MultiStepAgent
from smolagents.default_tools import PythonInterpreterTool
from smolagents.local_python_executor import BASE_BUILTIN_MODULES, LocalPythonExecutor
from smolagents.memory import ActionStep, PlanningStep, SystemPromptStep

from .events import EventStream
from .models import ScriptedModel, last_step_error
from .protocol import MAX_STEPS_CEILING

TOP_LEVEL_NAME = "manager"
#: The attribute that keeps a CodeAgent's own `additional_authorized_imports` (what the
#: program declared) once the run's list has replaced them.
DECLARED_IMPORTS = "orchestrator_declared_imports"
#: The attribute that keeps the executor type a CodeAgent asked for (`executor_type`) once
#: the local executor has replaced it.
DECLARED_EXECUTOR = "orchestrator_declared_executor"
#: The attribute a model carries for the record (program.py: class, model id, source).
MODEL_NOTE = "orchestrator_model"


@dataclass
class AgentNode:
    name: str
    agent: MultiStepAgent
    caller: str | None  # name of the agent that manages this one (None for the top level)
    #: Who set the agent's effective `max_steps`: "program", "manifest" or "run".
    max_steps_from: str = "program"


class Recorder:
    """Turns agent activity into events and keeps the run totals."""

    def __init__(self, events: EventStream) -> None:
        self.events = events
        self.names: dict[int, str] = {}  # id(agent) -> name
        self.callers: dict[int, str] = {}  # id(managed agent) -> caller name
        #: The agents running now, outermost first (the top level, then managed agents).
        self.running: list[MultiStepAgent] = []
        self.steps = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self._lock = threading.Lock()  # ToolCallingAgent may run managed agents in threads

    def on_step(self, step: ActionStep | PlanningStep, agent: MultiStepAgent | None = None) -> None:
        name = self.names.get(id(agent), getattr(agent, "name", None) or "?")
        usage = step.token_usage
        with self._lock:
            self.steps += 1
            if usage is not None:
                self.input_tokens += usage.input_tokens
                self.output_tokens += usage.output_tokens
        planning = isinstance(step, PlanningStep)
        error = None if planning else step.error
        if not planning and error is None and step.model_output is None:
            # The model call raised: smolagents re-raises it and reports the step from a
            # `finally` block, where the exception is still the one being handled.
            error = sys.exc_info()[1]
        self.events.emit(
            "step",
            agent=name,
            step_number=getattr(step, "step_number", getattr(agent, "step_number", None)),
            step_type="planning" if planning else "action",
            model_output=step.plan if planning else step.model_output,
            code=None if planning else step.code_action,
            tool_calls=None if planning else tool_calls_of(step),
            observations=None if planning else step.observations,
            error=error_dict(error),
            token_usage=None
            if usage is None
            else {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
            duration=step.timing.duration,
            is_final_answer=False if planning else step.is_final_answer,
        )

    def call_managed(self, original: Any, agent: MultiStepAgent, task: str, **kwargs: Any) -> Any:
        caller = self.callers.get(id(agent))
        if caller is None:  # not part of the tree we instrumented
            return original(agent, task, **kwargs)
        name = self.names[id(agent)]
        self.events.emit("managed_agent_call", caller=caller, agent=name, task=task)
        start = time.time()
        self.running.append(agent)
        try:
            output = original(agent, task, **kwargs)
        except BaseException as exc:
            self.running.remove(agent)
            self.events.emit(
                "managed_agent_result",
                caller=caller,
                agent=name,
                output=None,
                error=error_dict(exc),
                duration=time.time() - start,
            )
            raise
        self.running.remove(agent)
        self.events.emit(
            "managed_agent_result",
            caller=caller,
            agent=name,
            output=output,
            error=None,
            duration=time.time() - start,
        )
        return output

    def where(self) -> dict[str, Any]:
        """The agent running now (the innermost) and its step number, for an event that a
        step caused (egress attempts); {} before the tree is known."""
        if not self.running:
            return {}
        agent = self.running[-1]
        number = getattr(agent, "step_number", None)
        return {
            "agent": self.names.get(id(agent), getattr(agent, "name", None) or "?"),
            "step_number": number if isinstance(number, int) else None,
        }


def error_dict(exc: BaseException | None) -> dict[str, str] | None:
    if exc is None:
        return None
    return {"type": type(exc).__name__, "message": str(getattr(exc, "message", exc))}


def install_patches(authorized_imports: list[str], recorder: Recorder) -> None:
    """Patch smolagents at class level, before the payload is imported.

    Every CodeAgent then builds a LocalPythonExecutor with exactly `authorized_imports`, even
    with `executor_type="docker"/"e2b"/...` (no remote executor is ever started), and every
    call of a managed agent goes through the recorder.
    """
    imports = list(authorized_imports)

    def create_python_executor(self: CodeAgent) -> LocalPythonExecutor:
        if not hasattr(self, DECLARED_IMPORTS):  # the first call: still the program's list
            setattr(self, DECLARED_IMPORTS, list(self.additional_authorized_imports or []))
            setattr(self, DECLARED_EXECUTOR, self.executor_type)
        self.executor_type = "local"
        self.additional_authorized_imports = list(imports)
        self.authorized_imports = sorted(set(BASE_BUILTIN_MODULES) | set(imports))
        # executor_kwargs are meant for the payload's chosen executor: ignored. The executor's
        # own timeout only fires after the code returned (and would then discard a managed
        # agent's finished work): wall-clock limits are enforced from outside the sandbox.
        return LocalPythonExecutor(
            list(imports),
            max_print_outputs_length=self.max_print_outputs_length,
            timeout_seconds=None,
        )

    original_call = MultiStepAgent.__call__

    def monitored_call(self: MultiStepAgent, task: str, **kwargs: Any) -> Any:
        return recorder.call_managed(original_call, self, task, **kwargs)

    CodeAgent.create_python_executor = create_python_executor
    MultiStepAgent.__call__ = monitored_call


def walk(manager: MultiStepAgent) -> list[AgentNode]:
    """The whole tree, top level first, each agent once (an agent may be managed twice)."""
    nodes: list[AgentNode] = []
    seen: set[int] = set()
    pending: list[tuple[Any, str, str | None]] = [(manager, manager.name or TOP_LEVEL_NAME, None)]
    while pending:
        agent, name, caller = pending.pop(0)
        if id(agent) in seen:
            continue
        seen.add(id(agent))
        nodes.append(AgentNode(name, agent, caller))
        pending += [(sub, sub_name, name) for sub_name, sub in agent.managed_agents.items()]
    return nodes


def take_control(
    nodes: list[AgentNode],
    recorder: Recorder,
    authorized_imports: list[str],
    max_steps: int,
    mock_scripts: dict[str, list[str]] | None,
    model_id: str,
    max_steps_from: str = "manifest",
    *,
    keep_running: bool = False,
) -> None:
    """Make every agent of the tree obey the request and report to the recorder.

    Imports: every CodeAgent gets the run's list (the manifest is the ceiling); what it
    declared itself is kept for the record (`describe`). Steps: with `max_steps_from`
    "program" each agent keeps its own `max_steps` (up to MAX_STEPS_CEILING); otherwise the
    top level gets `max_steps` and the others at most that. `keep_running`: the caller
    says which agent runs (a program's top-level runs, program.py); else the top level."""
    interpreter_imports = sorted(set(BASE_BUILTIN_MODULES) | set(authorized_imports))
    if not keep_running:
        recorder.running = [nodes[0].agent]
    for node in nodes:
        agent = node.agent
        recorder.names[id(agent)] = node.name
        if node.caller is not None:
            recorder.callers[id(agent)] = node.caller
        own = agent.max_steps
        if max_steps_from == "program":
            agent.max_steps = min(own, MAX_STEPS_CEILING)
        else:
            agent.max_steps = max_steps if node.caller is None else min(own, max_steps)
        node.max_steps_from = "program" if agent.max_steps == own else max_steps_from
        if isinstance(agent, CodeAgent):
            # Whatever executor the payload made (or passed in), use ours; the system prompt is
            # rendered from `authorized_imports` at each run and in memory now.
            agent.python_executor = agent.create_python_executor()
            agent.memory.system_prompt = SystemPromptStep(system_prompt=agent.system_prompt)
        for tool in agent.tools.values():
            if isinstance(tool, PythonInterpreterTool):  # a ToolCallingAgent's code tool
                tool.authorized_imports = interpreter_imports
        if mock_scripts is not None:
            agent.model = ScriptedModel(
                node.name,
                mock_scripts.get(node.name, []),
                model_id,
                last_error=functools.partial(last_step_error, agent),
            )
            agent.monitor.tracked_model = agent.model
        agent.step_callbacks.register(ActionStep, recorder.on_step)
        agent.step_callbacks.register(PlanningStep, recorder.on_step)
    unknown = set(mock_scripts or {}) - {node.name for node in nodes}
    if unknown:
        print(f"orchestrator_runtime: no agent for mock scripts {sorted(unknown)}", file=sys.stderr)


def describe(node: AgentNode) -> dict[str, Any]:
    """One agent for `run_start`: what it is, and its effective settings with their source."""
    agent = node.agent
    declared = getattr(agent, DECLARED_IMPORTS, None)
    described = {
        "name": node.name,
        "kind": type(agent).__name__,
        "tools": sorted(agent.tools),
        "managed_agents": sorted(agent.managed_agents),
        "authorized_imports": list(getattr(agent, "authorized_imports", []) or []),
        "declared_imports": declared,
        "imports_not_granted": not_granted(agent),
        "max_steps": agent.max_steps,
        "max_steps_from": node.max_steps_from,
    }
    model = getattr(agent.model, MODEL_NOTE, None)
    if model is not None:  # a program's: what it chose, and what runs
        described["model"] = dict(model)
    asked = getattr(agent, DECLARED_EXECUTOR, None)
    if asked not in (None, "local"):  # asked for a remote executor: the local one runs
        described["executor"] = {"asked": asked, "runs": "local"}
    return described


def not_granted(agent: MultiStepAgent) -> list[str]:
    """The imports a CodeAgent declared that the run's list does not let it use."""
    declared = getattr(agent, DECLARED_IMPORTS, None) or []
    granted = set(getattr(agent, "authorized_imports", []) or [])
    if "*" in granted:
        return []
    prefixes = tuple(g[:-1] for g in granted if g.endswith(".*"))
    return sorted(
        {m for m in declared if m not in granted and not (prefixes and m.startswith(prefixes))}
    )


def tool_calls_of(step: ActionStep) -> list[dict[str, Any]] | None:
    """The tools an action step called, as smolagents read them from the model (a
    ToolCallingAgent's: its model output may be empty when the provider returns its calls as
    data, an MCP server's tools among them); None when none. A CodeAgent's one call, its
    code, is the step's `code` already."""
    calls = [c for c in step.tool_calls or () if c.name != "python_interpreter"]
    return [{"name": c.name, "arguments": c.arguments, "id": c.id} for c in calls] or None
