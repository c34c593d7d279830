"""A run's agent tree from its event stream: the manager's steps, and inside the step that
called it each managed agent's own steps (recursively), as the program ran them.

Events arrive in order of time: a step event is written when its step ends, so the managed
agent calls made during a step come before that step's event; they are kept pending on the
calling agent and attached to its next step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Step:
    number: int | None
    kind: str
    model_output: str | None
    code: str | None
    observations: str | None
    error: dict[str, Any] | None
    input_tokens: int | None
    output_tokens: int | None
    duration: float | None
    is_final_answer: bool
    #: The managed agents this step called (their nodes, in order).
    calls: list[AgentNode] = field(default_factory=list)


@dataclass
class AgentNode:
    name: str
    task: str | None = None
    steps: list[Step] = field(default_factory=list)
    output: Any = None
    error: Any = None
    duration: float | None = None
    #: False while the agent is still working (a live run).
    finished: bool = False
    #: Calls made since this agent's last step event (attached to its next step).
    pending: list[AgentNode] = field(default_factory=list)

    @property
    def all_calls(self) -> list[AgentNode]:
        return [call for step in self.steps for call in step.calls] + self.pending

    @property
    def tokens(self) -> tuple[int, int]:
        """Input and output tokens of this agent's steps and of every agent it called."""
        inp = sum(s.input_tokens or 0 for s in self.steps)
        out = sum(s.output_tokens or 0 for s in self.steps)
        for call in self.all_calls:
            i, o = call.tokens
            inp, out = inp + i, out + o
        return inp, out


def _int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _text(value: Any) -> str | None:
    return None if value is None else value if isinstance(value, str) else str(value)


def build_tree(events: list[dict[str, Any]]) -> AgentNode:
    """The root agent (named as `run_start` names it) with everything nested under it. Events
    naming an agent that was never called are put under the root rather than dropped: the
    stream is the sandbox's word, and a viewer shows what it said."""
    start = next((e for e in events if e.get("type") == "run_start"), {})
    agents = start.get("agents") or []
    root_name = agents[0].get("name") if agents and isinstance(agents[0], dict) else None
    root = AgentNode(name=str(root_name or "manager"))
    active: dict[str, list[AgentNode]] = {root.name: [root]}

    def current(name: Any) -> AgentNode:
        stack = active.get(str(name))
        return stack[-1] if stack else root

    for event in events:
        kind = event.get("type")
        if kind == "managed_agent_call":
            node = AgentNode(name=str(event.get("agent")), task=_text(event.get("task")))
            current(event.get("caller")).pending.append(node)
            active.setdefault(node.name, []).append(node)
        elif kind == "managed_agent_result":
            stack = active.get(str(event.get("agent"))) or []
            if stack and stack[-1] is not root:
                node = stack.pop()
                node.output, node.error = event.get("output"), event.get("error")
                node.duration, node.finished = _float(event.get("duration")), True
        elif kind == "step":
            agent = current(event.get("agent"))
            usage = event.get("token_usage") or {}
            usage = usage if isinstance(usage, dict) else {}
            error = event.get("error")
            agent.steps.append(
                Step(
                    number=_int(event.get("step_number")),
                    kind=str(event.get("step_type") or "action"),
                    model_output=_text(event.get("model_output")),
                    code=_text(event.get("code")),
                    observations=_text(event.get("observations")),
                    error=error if isinstance(error, dict) or error is None else {"message": error},
                    input_tokens=_int(usage.get("input_tokens")),
                    output_tokens=_int(usage.get("output_tokens")),
                    duration=_float(event.get("duration")),
                    is_final_answer=bool(event.get("is_final_answer")),
                    calls=agent.pending,
                )
            )
            agent.pending = []
        elif kind in ("run_end", "run_finished"):
            root.finished = True
    return root


def count_steps(node: AgentNode) -> int:
    return len(node.steps) + sum(count_steps(call) for call in node.all_calls)
