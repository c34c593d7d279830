"""Models handed to the payload (scripted `mock` or a real endpoint) and model-failure triage."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from smolagents.models import (
    ChatMessage,
    ChatMessageStreamDelta,
    MessageRole,
    Model,
    remove_content_after_stop_sequences,
)
from smolagents.monitoring import TokenUsage

from .request import Request


class MockScriptExhausted(RuntimeError):
    """A scripted agent asked for more model outputs than its script holds."""


class ScriptedModel(Model):
    """Plays one agent's script in order, like a model would answer; needs no network.

    Stop sequences are applied as a real endpoint would, and token usage is a rough estimate
    (4 characters a token) so that accounting code sees plausible numbers. `last_error`
    returns the agent's latest step error, so that a script running out because a step failed
    (an undefined name, a managed agent without a script) names that failure first: it is
    the cause, the exhausted script only its consequence.
    """

    def __init__(
        self,
        agent_name: str | None,
        outputs: list[str],
        model_id: str = "scripted",
        last_error: Callable[[], str | None] | None = None,
    ):
        super().__init__(model_id=model_id)
        self.agent_name = agent_name
        self.outputs = list(outputs)
        self.calls = 0
        self.last_error = last_error

    def generate(
        self,
        messages: list[ChatMessage | dict],
        stop_sequences: list[str] | None = None,
        response_format: dict[str, str] | None = None,
        tools_to_call_from: list[Any] | None = None,
        **kwargs: Any,
    ) -> ChatMessage:
        if self.agent_name is None:
            raise MockScriptExhausted(
                "the mock model was called by an agent that is not in the manager's tree of "
                "managed agents, so no script is known for it"
            )
        if self.calls >= len(self.outputs):
            exhausted = (
                f"mock script of agent '{self.agent_name}' is exhausted: it holds "
                f"{len(self.outputs)} output(s) and the agent asked for output {self.calls + 1}"
            )
            cause = self.last_error() if self.last_error else None
            if cause:  # the real failure first; the script ran out because of it
                exhausted = f"agent '{self.agent_name}' failed: {cause} (and then its {exhausted})"
            raise MockScriptExhausted(exhausted)
        text = self.outputs[self.calls]
        self.calls += 1
        content = remove_content_after_stop_sequences(text, stop_sequences)
        return ChatMessage(
            role=MessageRole.ASSISTANT,
            content=content,
            token_usage=TokenUsage(
                input_tokens=_estimate_tokens(messages), output_tokens=max(1, len(content) // 4)
            ),
        )

    def generate_stream(
        self, messages: list[Any], **kwargs: Any
    ) -> Iterator[ChatMessageStreamDelta]:
        """One delta with the whole output, so agents built with `stream_outputs=True` work."""
        message = self.generate(messages, **kwargs)
        yield ChatMessageStreamDelta(content=message.content, token_usage=message.token_usage)


def action_outputs(agent: Any, count: int, *, top: bool = True) -> list[int]:
    """The indexes of a mock script's outputs that are certainly answers to an action step
    (the others: plans, and what follows the agent's max_steps, are free text). An agent
    with `planning_interval` asks for a plan before step 1 and every interval steps after;
    a managed one may be called again after any step, its plan then coming early, so only
    its first action is certain (a false refusal would stop a good run)."""
    steps = getattr(agent, "max_steps", None) or count
    interval = getattr(agent, "planning_interval", None)
    if not interval:
        return list(range(min(count, steps)))
    actions: list[int] = []
    index = 0
    for step in range(1, steps + 1):
        index += 1 if step == 1 or (step - 1) % interval == 0 else 0  # the plan's output
        if index >= count or (actions and not top):
            break
        actions.append(index)
        index += 1
    return actions


def script_problems(name: str, agent: Any, outputs: list[str], *, top: bool = True) -> list[str]:
    """What in agent `name`'s mock script its agent cannot parse, one line per output (found
    by `validate`, refused by a run before its first step: the run would fail at that
    output with "mock script ... is exhausted"). A CodeAgent needs a code block in each
    action output; a ToolCallingAgent a tool call as JSON (`action_outputs`: which those
    are). `top`: the agent the run calls (once), not a managed one."""
    from smolagents import CodeAgent, ToolCallingAgent
    from smolagents.models import get_tool_call_from_text
    from smolagents.utils import parse_code_blobs

    problems = []
    for index in action_outputs(agent, len(outputs), top=top):
        text = outputs[index]
        where = f"mock script of agent {name!r}, output {index + 1} of {len(outputs)}"
        if isinstance(agent, CodeAgent) and not getattr(
            agent, "_use_structured_outputs_internally", False
        ):
            opening, closing = agent.code_block_tags
            try:
                parse_code_blobs(text, agent.code_block_tags)
            except ValueError:
                problems.append(
                    f"{where}: no code block; a CodeAgent runs only the code between "
                    f"{opening} and {closing} (e.g. {opening}\nfinal_answer(42)\n{closing})"
                )
        elif isinstance(agent, ToolCallingAgent):
            model = agent.model
            try:
                get_tool_call_from_text(
                    text,
                    getattr(model, "tool_name_key", "name"),
                    getattr(model, "tool_arguments_key", "arguments"),
                )
            except Exception as exc:
                detail = " ".join(str(exc).split())[:300]
                problems.append(
                    f"{where}: no tool call a ToolCallingAgent can read ({detail}); write it "
                    'as JSON, e.g. Action: {"name": "final_answer", "arguments": {"answer": '
                    '"42"}}'
                )
    return problems


def last_step_error(agent: Any) -> str | None:
    """The error of the agent's latest step that failed, as `Type: message`, or None."""
    for step in reversed(getattr(agent.memory, "steps", [])):
        error = getattr(step, "error", None)
        if error is not None:
            message = " ".join(str(getattr(error, "message", error)).split())
            return f"{type(error).__name__}: {message[:2000]}"
    return None


def _estimate_tokens(messages: list[ChatMessage | dict]) -> int:
    chars = 0
    for message in messages:
        content = message.content if isinstance(message, ChatMessage) else message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(str(part.get("text", ""))) for part in content if isinstance(part, dict)
            )
    return max(1, chars // 4)


def build_model(request: Request) -> Model:
    """The model passed to the payload's entrypoint. Client libraries are imported lazily."""
    key = request.secrets.get(request.credential_env) if request.credential_env else None
    options = dict(request.options)
    if request.provider == "mock":
        # A placeholder: each agent of the tree gets its own ScriptedModel once the tree is known.
        return ScriptedModel(None, [], model_id=request.model_id)
    if request.provider == "openai":
        from smolagents.models import OpenAIServerModel

        # Local OpenAI-compatible servers often need no key, but the client insists on one.
        return OpenAIServerModel(
            request.model_id, api_base=request.api_base, api_key=key or "unused", **options
        )
    if request.provider == "hf":
        if request.api_base:
            # An OpenAI-compatible base URL: the run's model gateway (which forwards to Hugging
            # Face's router, https://router.huggingface.co/v1), or an Inference Endpoint / TGI
            # server's /v1. huggingface_hub's client cannot take both a base URL and a model
            # id, and the router needs the id, so these speak OpenAI's protocol directly.
            from smolagents.models import OpenAIServerModel

            return OpenAIServerModel(
                request.model_id, api_base=request.api_base, api_key=key or "unused", **options
            )
        from smolagents.models import InferenceClientModel

        return InferenceClientModel(request.model_id, token=key, **options)
    if request.provider == "bedrock":  # signs with the AWS credentials in the environment
        from smolagents.models import AmazonBedrockModel

        client_kwargs = {"endpoint_url": request.api_base} if request.api_base else {}
        model = AmazonBedrockModel(request.model_id, client_kwargs=client_kwargs, **options)
        keep_tool_calls(model.client)
        return model
    from smolagents.models import LiteLLMModel

    return LiteLLMModel(request.model_id, api_base=request.api_base, api_key=key, **options)


def keep_tool_calls(client: Any) -> None:
    """Have a Bedrock client's parsed converse answers hold `tool_calls` (None when absent).
    smolagents' AmazonBedrockModel reads `message["tool_calls"]`, a field Bedrock's converse
    never returns, and fails on every answer without it; botocore's own event hook adds
    it to each answer as the client parses it, and the client is otherwise untouched."""

    def add_tool_calls(parsed: dict[str, Any], **_: Any) -> None:
        message = (parsed.get("output") or {}).get("message")
        if isinstance(message, dict):
            message.setdefault("tool_calls", None)

    client.meta.events.register("after-call.bedrock-runtime.Converse", add_tool_calls)


#: Exception class names (anywhere in the MRO) meaning "the model endpoint could not answer":
#: openai, httpx, requests, urllib3, litellm, botocore and socket spell them differently.
_UNAVAILABLE_NAMES = frozenset(
    {
        "APIConnectionError",
        "APITimeoutError",
        "RateLimitError",
        "InternalServerError",
        "ServiceUnavailableError",
        "BadGatewayError",
        "Timeout",
        "TransportError",
        "ConnectError",
        "ConnectTimeout",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ReadTimeout",
        "TimeoutException",
        "RemoteProtocolError",
        "NewConnectionError",
        "MaxRetryError",
        "ProtocolError",
        "gaierror",
    }
)


def _status_code(exc: BaseException) -> int | None:
    for holder in (exc, getattr(exc, "response", None)):
        status = getattr(holder, "status_code", None)
        if isinstance(status, int):
            return status
    return None


#: Packages whose connection errors are a tool server's, never the model's: MCP's client and
#: smolagents' adapter of it ("Couldn't connect to the MCP server" is a TimeoutError).
_TOOL_CLIENTS = frozenset({"mcp", "mcpadapt"})


def _raised_in_tool_client(exc: BaseException) -> bool:
    """True when the traceback of `exc` passes through a tool client's code."""
    tb = exc.__traceback__
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if module.split(".", 1)[0] in _TOOL_CLIENTS:
            return True
        tb = tb.tb_next
    return False


def is_model_unavailable(exc: BaseException) -> bool:
    """True when the exception chain shows a connection error or an HTTP 429/5xx answer,
    unless it came from an MCP client (its server out of reach: the program's error)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _raised_in_tool_client(current):
            return False
        if isinstance(current, ConnectionError | TimeoutError):
            return True
        if any(cls.__name__ in _UNAVAILABLE_NAMES for cls in type(current).__mro__):
            return True
        status = _status_code(current)
        if status is not None and (status == 429 or 500 <= status <= 599):
            return True
        current = current.__cause__ or current.__context__
    return False
