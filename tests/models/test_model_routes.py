"""Each model on its own protocol: a program's LiteLLM, OpenAI and Azure models keep their
client and its protocol, and only their endpoint (the run's gateway) and key (a run token)
change; the host's key goes where each provider expects it.

The host learns where a LiteLLM provider is served from LiteLLM itself (`upstreams.py`);
the whole path runs against the real engine with a server that speaks every protocol
(tests/provider_servers.py), and a program that hashes every environment value and every
file under /tmp and $HOME in its sandbox finds no host key.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path

import pytest

from orchestrator.models import Upstream
from orchestrator.paths import home_dir
from orchestrator.payloads.upstreams import litellm_upstream, probe_many
from orchestrator_runtime.gateway.usage import UsageReader, requested_model
from tests.conftest import cli
from tests.provider_servers import ProviderServer

ANSWER = "Thought: I answer.\n<code>\nfinal_answer('routed')\n</code>"

#: The program's prelude: every environment value of every process it can read, and every
#: file under /tmp and $HOME, hashed (never printed).
HASHING_PRELUDE = """
import hashlib, os
from pathlib import Path

values = set(os.environ.values())
for entry in Path("/proc").iterdir():
    if entry.name.isdigit():
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        values.update(i.partition(b"=")[2].decode(errors="replace") for i in raw.split(b"\\0"))
for root in {"/tmp", os.path.expanduser("~")}:
    for path in Path(root).rglob("*"):
        try:
            if path.is_file():
                values.add(path.read_bytes().decode(errors="replace"))
                values.update(path.read_bytes().decode(errors="replace").split())
        except OSError:
            pass
for value in sorted(values):
    print("sha256", hashlib.sha256(value.encode()).hexdigest())
"""

#: One model each, as a program writes it: (import, constructor, key variable).
MODELS = {
    "anthropic": (
        "LiteLLMModel",
        'LiteLLMModel(model_id="anthropic/claude-sonnet-4-5", '
        'api_key=os.environ["ANTHROPIC_API_KEY"])',
        "ANTHROPIC_API_KEY",
    ),
    "gemini": (
        "LiteLLMModel",
        'LiteLLMModel(model_id="gemini/gemini-2.5-flash", api_key=os.getenv("GEMINI_API_KEY"))',
        "GEMINI_API_KEY",
    ),
    "litellm-openai": (
        "LiteLLMModel",
        'LiteLLMModel(model_id="openai/gpt-4o-mini", api_key=os.environ["OPENAI_API_KEY"])',
        "OPENAI_API_KEY",
    ),
    "openai": (
        "OpenAIServerModel",
        'OpenAIServerModel(model_id="gpt-4o-mini", api_key=os.environ["OPENAI_API_KEY"])',
        "OPENAI_API_KEY",
    ),
    "azure": (
        "AzureOpenAIServerModel",
        'AzureOpenAIServerModel(model_id="prod-gpt4o", api_version="2024-10-21")',
        "AZURE_OPENAI_API_KEY",
    ),
}


def write_program(folder: Path, kind: str, *, stream: bool) -> Path:
    cls, constructor, _ = MODELS[kind]
    path = folder / f"{kind.replace('-', '_')}.py"
    path.write_text(
        HASHING_PRELUDE
        + f"from smolagents import CodeAgent, {cls}\n"
        + f"model = {constructor}\n"
        + f"agent = CodeAgent(tools=[], model=model, stream_outputs={stream})\n"
        + 'print("answer:", agent.run("Say routed."))\n'
    )
    return path


# ---- the host: where LiteLLM says each provider is served -------------------------------------


def test_litellm_names_anthropics_endpoint_call_and_key_header() -> None:
    upstream = litellm_upstream("anthropic/claude-sonnet-4-5")
    assert upstream.provider == "anthropic"
    assert upstream.base == "https://api.anthropic.com"
    assert upstream.path == "/v1/messages"
    assert upstream.key_header == "x-api-key"
    assert upstream.key_env == "ANTHROPIC_API_KEY"
    assert upstream.describe()["upstream_host"] == "api.anthropic.com"
    assert litellm_upstream("anthropic/claude-sonnet-4-5") == upstream  # kept: no 2nd probe
    assert (home_dir() / "cache" / "litellm-upstreams.json").is_file()


def test_litellm_names_each_providers_endpoint_and_what_it_does_not_know() -> None:
    found = probe_many(
        ["gemini/gemini-2.5-flash", "groq/llama-3.1-8b-instant", "no-such-provider/model"]
    )
    gemini, groq, unknown = found.values()
    assert isinstance(gemini, Upstream) and isinstance(groq, Upstream)
    assert gemini.base == "https://generativelanguage.googleapis.com/v1beta"
    assert gemini.path == "/models/gemini-2.5-flash:generateContent"
    assert gemini.key_header == "x-goog-api-key"
    assert (groq.base, groq.path, groq.key_header, groq.key_env) == (
        "https://api.groq.com/openai/v1",
        "/chat/completions",
        "authorization",
        "GROQ_API_KEY",
    )
    assert isinstance(unknown, str) and "no-such-provider" in unknown


def test_a_model_litellm_cannot_place_is_refused_by_validate_with_the_fix(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text(
        "from smolagents import CodeAgent, LiteLLMModel\n"
        'agent = CodeAgent(tools=[], model=LiteLLMModel(model_id="no-such-provider/m"))\n'
        'agent.run("hi")\n'
    )
    done = cli("validate", "--no-load", str(program))
    assert done.returncode == 2, done.stderr
    assert "no-such-provider/m" in done.stderr and "--api-base" in done.stderr


def test_geminis_usage_and_model_are_read_from_its_own_fields() -> None:
    reader = UsageReader("text/event-stream")
    for count in (1, 7):
        usage = {"promptTokenCount": 11, "candidatesTokenCount": count, "thoughtsTokenCount": 2}
        reader.feed(f"data: {json.dumps({'usageMetadata': usage})}\n\n".encode())
    reader.close()
    assert (reader.input_tokens, reader.output_tokens) == (11, 9)  # thoughts billed as output
    path = "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
    assert requested_model(b"{}", path) == "gemini-2.5-flash"


# ---- the whole path: each protocol through the run's gateway ----------------------------------


@pytest.mark.docker
@pytest.mark.parametrize(
    ("kind", "stream"),
    [
        ("anthropic", False),
        ("anthropic", True),
        ("gemini", False),
        ("gemini", True),
        ("litellm-openai", False),
        ("openai", True),
        ("azure", False),
    ],
)
def test_each_protocol_reaches_its_server_with_the_hosts_key(
    tmp_path: Path, kind: str, stream: bool
) -> None:
    key = f"sk-host-{secrets.token_hex(12)}"
    program = write_program(tmp_path, kind, stream=stream)
    _, _, key_env = MODELS[kind]
    with ProviderServer([ANSWER], key=key) as server:
        env = {key_env: key}
        args = ["run", "--json", "--timeout", "300"]
        if kind == "azure":
            env["AZURE_OPENAI_ENDPOINT"] = server.base()  # where Azure's client looks
        elif kind == "anthropic":
            env["ANTHROPIC_API_BASE"] = server.base()  # the user's own LiteLLM setting
        elif kind == "gemini":
            args += ["--api-base", server.base() + "/v1beta"]
        else:
            args += ["--api-base", server.base() + "/v1"]
        done = cli(*args, str(program), env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["status"] == "succeeded" and outcome["answer"] == "routed"
    # The call came in the provider's own protocol, with the host's key where it belongs.
    protocol = {"litellm-openai": "openai"}.get(kind, kind)
    (call,) = server.calls(protocol)
    assert len(server.requests) == 1
    if kind == "anthropic":
        assert call["path"] == "/v1/messages" and call["headers"]["x-api-key"] == key
        assert call["body"]["model"] == "claude-sonnet-4-5"
        assert outcome["gateway"]["protocol"] == "POST /v1/messages"
        assert outcome["gateway"]["key_header"] == "x-api-key"
    elif kind == "gemini":
        action = "streamGenerateContent" if stream else "generateContent"
        assert call["path"].startswith(f"/v1beta/models/gemini-2.5-flash:{action}")
        assert call["headers"]["x-goog-api-key"] == key
    elif kind == "azure":
        assert call["path"].startswith("/openai/deployments/prod-gpt4o/chat/completions")
        assert "api-version=2024-10-21" in call["path"]
        assert call["headers"]["api-key"] == key
    else:
        assert call["path"] == "/v1/chat/completions"
        assert call["headers"]["authorization"] == f"Bearer {key}"
        assert call["body"]["model"] == "gpt-4o-mini"
    assert bool(call["body"].get("stream")) or ":stream" in call["path"] or not stream
    # Tokens as the host's gateway measured them, the server's own figures.
    assert outcome["token_usage_source"] == "gateway"
    assert {k: outcome["token_usage"][k] for k in server.usage} == server.usage
    # The program's class and provider are kept, and no host key is anywhere inside.
    record = Path(outcome["record_dir"])
    logs = (record / "stderr.log").read_text()
    hashes = {line.split()[1] for line in logs.splitlines() if line.startswith("sha256 ")}
    assert len(hashes) > 5
    assert hashlib.sha256(key.encode()).hexdigest() not in hashes
    assert key not in done.stdout + done.stderr
    events = [json.loads(line) for line in (record / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["type"] == "run_start")
    model = start["agents"][0]["model"]
    aliases = {"OpenAIServerModel": "OpenAIModel", "AzureOpenAIServerModel": "AzureOpenAIModel"}
    assert model["class"] == aliases.get(MODELS[kind][0], MODELS[kind][0])
    assert model["routed_to"] == "gateway"
    assert "runs" not in model  # its own model, not another in its place


@pytest.mark.docker
def test_a_litellm_model_with_no_endpoint_is_served_where_litellm_says(tmp_path: Path) -> None:
    """No --api-base, no LiteLLM setting: validate accepts it, and the run's gateway forwards
    to Anthropic's own endpoint (unreachable from here: the run fails there, not before)."""
    program = tmp_path / "anthropic_plain.py"
    program.write_text(
        "from smolagents import CodeAgent, LiteLLMModel\n"
        'model = LiteLLMModel(model_id="anthropic/claude-sonnet-4-5")\n'
        'CodeAgent(tools=[], model=model).run("Say hi.")\n'
    )
    env = {"ANTHROPIC_API_KEY": f"sk-ant-{secrets.token_hex(8)}", "ANTHROPIC_API_BASE": ""}
    checked = cli("validate", "--no-load", str(program), env=env)
    assert checked.returncode == 0, checked.stderr
    done = cli("run", "--json", "--timeout", "120", str(program), env=env, timeout=600)
    outcome = json.loads(done.stdout)
    assert outcome["status"] != "succeeded"
    gateway = outcome["gateway"]
    assert gateway["upstream"] == "https://api.anthropic.com"
    assert gateway["upstream_host"] == "api.anthropic.com"
    assert (gateway["protocol"], gateway["key_header"]) == ("POST /v1/messages", "x-api-key")
    assert gateway["key_from"] == "ANTHROPIC_API_KEY"
