"""What the host and the in-sandbox runtime share: defined here once, imported by both.

Standard library only. The host (`orchestrator`) may import this module; the runtime never
imports the host. docs/PROTOCOL.md describes the protocol these constants belong to.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: The request's `protocol` field; the runtime refuses any other.
PROTOCOL_VERSION = 1

#: Names both sides check the same way (the host when it reads a manifest or a schedules
#: file, the runtime when it reads a request): an entrypoint `module:function`, a module an
#: agent may import (`*`, `pkg`, `pkg.*`), an environment variable (a secret's name).
ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
MODULE_RE = re.compile(r"^(\*|[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\.\*)?)$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: The most steps any agent may take, whoever set its `max_steps`: the runtime holds every
#: agent to it, and the host's range of `max_steps` ends here (`orchestrator.spec.Limits`).
MAX_STEPS_CEILING = 1000


def unknown_script_problem(name: str, agents: list[str]) -> str:
    """The words for a mock script keyed by no agent: the runtime says them of the tree it
    loaded (`tree_problems`), the host of the agent names it read in the payload's source
    (`orchestrator.payloads.agentnames`), before any sandbox. One function, so both say the same."""
    return (
        f"mock script for {name!r}, which is not an agent of the tree (agents: {', '.join(agents)})"
    )


#: Model providers the runtime can build (`provider:model_id` on the host's command line).
PROVIDERS = ("mock", "openai", "hf", "litellm", "bedrock")
#: smolagents' model classes whose calls a run's model gateway can serve, each with the
#: provider the host knows it by: a program's own models of these classes keep their class,
#: their client and its protocol; only the client's endpoint (the gateway) and key (the run
#: token; for Bedrock, whose client signs, the run's own AWS credentials) change. Azure's
#: classes first: they subclass OpenAI's.
ROUTABLE_MODELS = {
    "AzureOpenAIServerModel": "openai",
    "AzureOpenAIModel": "openai",
    "InferenceClientModel": "hf",
    "OpenAIServerModel": "openai",
    "OpenAIModel": "openai",
    "LiteLLMModel": "litellm",
    "AmazonBedrockModel": "bedrock",
    "AmazonBedrockServerModel": "bedrock",
}
#: Where an AWS client reads its region (a Bedrock model's sandbox gets both: AWS's SDKs
#: read the first, botocore the second) and Bedrock Runtime's endpoint (the run's gateway).
AWS_REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")
BEDROCK_ENDPOINT_ENV = "AWS_ENDPOINT_URL_BEDROCK_RUNTIME"
#: The variable a routable class's client reads its key from when given none, where it is
#: not its provider's (`openai`'s is OPENAI_API_KEY; Azure's client reads its own).
CLASS_KEY_ENV = {
    "AzureOpenAIServerModel": "AZURE_OPENAI_API_KEY",
    "AzureOpenAIModel": "AZURE_OPENAI_API_KEY",
}

#: The client libraries a model may import when the runtime builds it, which the runtime can
#: import ahead (`--preload MODULE`): about 0.6 s for openai, paid while a pooled sandbox idles.
#: `--preload traces` imports the runtime's tracing (OpenTelemetry and the smolagents
#: instrumentation, about 0.1 s), for runs whose request will carry a `trace`.
PRELOAD_TRACES = "traces"
PRELOADABLE = ("openai", "litellm", PRELOAD_TRACES)


def model_client_module(provider: str, *, has_api_base: bool) -> str | None:
    """The client library the runtime's model of `provider` imports (None: smolagents' own
    imports already hold it). hf with a base URL speaks OpenAI's protocol (see the runtime's
    `build_model`)."""
    if provider == "openai" or (provider == "hf" and has_api_base):
        return "openai"
    if provider == "litellm":
        return "litellm"
    return None


#: Where the runtime also writes its `run_end` event, for a host whose live stream broke.
RESULT_PATH = "/tmp/orchestrator-result.json"

#: Modules that void the inner executor's guard if agent code may import them. The host
#: refuses them before a run starts (unless the user accepts the risk by name); the runtime
#: checks again. Private modules (`_io`, `_posixsubprocess`, ...) give the same powers, so any
#: `_name` is refused too.
DANGEROUS_IMPORTS = frozenset(
    {
        "*",
        "os",
        "posix",
        "nt",
        "subprocess",
        "socket",
        "sys",
        "shutil",
        "importlib",
        "ctypes",
        "pickle",
        "marshal",
        "builtins",
        "io",
        "pathlib",
        "multiprocessing",
        "pty",
        "signal",
        "threading",
        "_thread",
        "code",
        "codeop",
        "inspect",
        "gc",
        "resource",
        "fcntl",
        "mmap",
        "tempfile",
        "glob",
        "asyncio",
        "concurrent",
        "runpy",
        "sysconfig",
        "urllib",
        "http",
        "requests",
        "httpx",
        "ftplib",
        "smtplib",
        "telnetlib",
        "webbrowser",
    }
)


def is_dangerous_import(module: str) -> bool:
    """True for `os`, `os.path`, `os.*`, `*`, `_io`... (a module or any submodule of one)."""
    root = module.split(".")[0]
    return module == "*" or root in DANGEROUS_IMPORTS or root.startswith("_")


#: The longest frame (one JSON line) on the event channel; a longer one is a violation, and
#: the host keeps at most this much of any output line.
MAX_FRAME_BYTES = 1024 * 1024


class FrameCheck:
    """The event channel's rules, frame by frame: one JSON object with a string `type`,
    numbered `seq` 0, 1, 2, ..., and one `run_end`, last. The runtime's relay checks the
    agent process's frames with it, and the host checks the relayed stream again."""

    def __init__(self) -> None:
        self.expected = 0
        self.ended = False

    def check(self, line: str | bytes) -> tuple[Any, str | None]:
        """`(frame, None)` for a good frame (the count moves on), else `(frame, what is
        wrong)`, with no frame when the line is not one."""
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            return None, "a line on the event channel that is not an event"
        if self.ended:
            what = "a second run_end" if event["type"] == "run_end" else f"a {event['type']} frame"
            return event, f"{what} after the run's end"
        seq = event.get("seq")
        if isinstance(seq, bool) or seq != self.expected:
            return event, f"a frame out of sequence (seq {seq!r}, expected {self.expected})"
        self.expected += 1
        self.ended = event["type"] == "run_end"
        return event, None


#: Bounds on one span of the sandbox (`span` events): its attributes, its events, and its JSON.
#: The runtime keeps its spans within them; the host checks them again (and its own bounds
#: on the count and the total, orchestrator/records/spans.py), flagging what was cut.
MAX_SPAN_ATTRIBUTES = 128
MAX_SPAN_EVENTS = 32
MAX_SPAN_BYTES = 256 * 1024
#: The longest attribute value of a span (characters; a model's message history is long).
MAX_ATTRIBUTE_CHARS = 32 * 1024


#: What a pooled sandbox's runtime writes on stderr once it has imported everything and waits
#: for its request (never on stdout: that is the event channel, and its frames start at 0).
READY_LINE = "orchestrator_runtime: ready for a request\n"

#: The first line the host writes on the stdin of a sandbox restored from a snapshot, as soon
#: as it is restored (its runtime was checkpointed waiting for it, `RESTORABLE_ENV` set by
#: the keeper), before the request: the runtime then reseeds what every clone of the
#: snapshot shares and tells its keeper, whose idle time starts again.
RESTORED_LINE = "orchestrator: restored from a snapshot\n"
#: RESTORED_LINE of a host that waits for the runtime's word that the restore is over
#: (runsc-direct: the restore runs on the host's cores, and the sandbox is held to its run's
#: CPU limit once it is over, before the request): the runtime answers RESTORE_DONE_LINE.
RESTORED_ACK_LINE = "orchestrator: restored from a snapshot, say when\n"
#: What the runtime writes on stderr once it read RESTORED_ACK_LINE and reseeded.
RESTORE_DONE_LINE = "orchestrator_runtime: restored\n"

#: Set to "1" in the environment of a pooled sandbox's runtime whose idle lifetime is kept
#: from outside (E2B: the sandbox's own timeout) rather than by the deadline keeper, whose
#: pipe otherwise says the sandbox is pooled: the runtime then writes READY_LINE too.
POOLED_ENV = "ORCHESTRATOR_POOLED"
