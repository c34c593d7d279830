"""The in-sandbox runtime, run as `python -m orchestrator_runtime` in a local subprocess.

No Docker here: these tests pin down the protocol (docs/PROTOCOL.md) that every backend relies
on: the event stream, the inner executor's import guard, secret masking and exit codes.
"""

from __future__ import annotations

import base64
import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from tests.conftest import EXAMPLES, REPO, TEST_PAYLOADS
from tests.runtime_zygote import shared_zygote

SECRET = "correct-horse-battery\nstaple-9d2f41\n  third line with spaces  "
EXAMPLE_SECRET = "tok-5e1f0c2a9b7d"


def manifest_of(folder: Path) -> dict[str, Any]:
    return tomllib.loads((folder / "manifest.toml").read_text(encoding="utf-8"))


def build_request(folder: Path, **overrides: Any) -> dict[str, Any]:
    """A request as the host builds it from a payload folder and its manifest."""
    manifest = manifest_of(folder)
    files = {
        path.relative_to(folder).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix in {".py", ".json", ".csv"}
        if "__pycache__" not in path.parts
    }
    secrets = {name: EXAMPLE_SECRET for name in manifest.get("secrets", {}).get("required", [])}
    request = {
        "protocol": 1,
        "run_id": f"r-test-{folder.name}",
        "task": manifest["payload"].get("example_task", "Do the task."),
        "additional_args": None,
        "payload": {
            "name": manifest["payload"]["name"],
            "entrypoint": manifest["payload"]["entrypoint"],
            "files": files,
        },
        "authorized_imports": manifest.get("python", {}).get("authorized_imports", []),
        "allow_dangerous_imports": False,
        "max_steps": manifest.get("limits", {}).get("max_steps", 6),
        "model": {"provider": "mock", "model_id": "scripted", "api_base": None, "options": {}},
        "mock_scripts": manifest.get("mock", {}).get("scripts", {}),
        "secrets": secrets,
        "result_path": None,
    }
    request.update(overrides)
    return request


@dataclass
class RuntimeExit:
    """What the in-sandbox runtime left when it exited: its status, its event stream and
    its output."""

    returncode: int
    events: list[dict[str, Any]]
    stdout: str
    stderr: str

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type_]

    @property
    def end(self) -> dict[str, Any]:
        return self.events[-1]


def run_runtime(
    request: dict[str, Any] | bytes,
    timeout: float = 120,
    args: tuple[str, ...] = (),
    *,
    fresh: bool = False,
) -> RuntimeExit:
    """One run of the runtime: a child of the session's zygote, or with `fresh` a new
    `python -m orchestrator_runtime` (for what only the whole command shows: its command
    line, the exit of a process that imported nothing before)."""
    raw = request if isinstance(request, bytes) else json.dumps(request).encode()
    if fresh:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator_runtime", *args],
            input=raw,
            cwd=REPO,
            capture_output=True,
            timeout=timeout,
        )
        status, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        status, out, err = shared_zygote().run(raw, args, timeout)
    stdout = out.decode()
    events = []
    for line in stdout.splitlines():
        event = json.loads(line)  # every stdout line must be one JSON object
        assert isinstance(event, dict), line
        events.append(event)
    outcome = RuntimeExit(status, events, stdout, err.decode(errors="replace"))
    check_stream(outcome)
    return outcome


def check_stream(outcome: RuntimeExit) -> None:
    """Invariants of every stream: numbered envelope, run_start first, one run_end last."""
    events = outcome.events
    assert events, f"no events; stderr:\n{outcome.stderr[-3000:]}"
    assert [e["seq"] for e in events] == list(range(len(events)))
    for event in events:
        assert {"type", "seq", "ts", "run_id"} <= event.keys()
    assert [e["type"] for e in events].count("run_end") == 1
    assert events[-1]["type"] == "run_end"
    if any(e["type"] == "run_start" for e in events):
        assert events[0]["type"] == "run_start"
    expected_exit = {"success": 0, "max_steps_error": 1}.get(events[-1]["state"])
    if expected_exit is not None:
        assert outcome.returncode == expected_exit, outcome.stderr[-3000:]


# --- the example payloads ------------------------------------------------------------------


@pytest.mark.parametrize("folder", EXAMPLES, ids=lambda p: p.name)
def test_example_payload_runs_its_mock_trajectory(folder: Path) -> None:
    manifest = manifest_of(folder)
    outcome = run_runtime(build_request(folder))
    assert outcome.returncode == 0, outcome.stderr[-3000:]

    start = outcome.events[0]
    assert start["payload"] == manifest["payload"]["name"]
    top = start["agents"][0]
    assert top["name"] == "manager" and top["managed_agents"]

    calls = outcome.of_type("managed_agent_call")
    results = outcome.of_type("managed_agent_result")
    assert calls and calls[0]["caller"] == "manager" and calls[0]["agent"] in top["managed_agents"]
    assert results and results[0]["error"] is None and results[0]["output"]

    steps = outcome.of_type("step")
    failed = [s for s in steps if s["error"]]
    assert failed, "the trajectory should contain a code error"
    first = failed[0]
    assert first["error"]["type"] == "AgentExecutionError" and first["code"]
    fixed = [
        s
        for s in steps
        if s["agent"] == first["agent"] and s["step_number"] == first["step_number"] + 1
    ]
    assert fixed and fixed[0]["error"] is None, "the agent should correct its error next step"
    assert all(s["token_usage"]["input_tokens"] > 0 for s in steps)
    assert all(s["duration"] is not None and s["duration"] >= 0 for s in steps)

    answer = manifest["payload"]["example_answer"]
    assert [str(e["answer"]) for e in outcome.of_type("final_answer")] == [answer]
    end = outcome.end
    assert end["state"] == "success" and str(end["answer"]) == answer and end["error"] is None
    assert end["steps"] == len(steps)
    assert end["token_usage"]["input_tokens"] == sum(
        s["token_usage"]["input_tokens"] for s in steps
    )


def test_run_start_describes_the_tree_with_the_requested_imports_and_caps() -> None:
    folder = REPO / "agent_payloads" / "research_team"
    request = build_request(folder, authorized_imports=["json", "base64"], max_steps=3)
    outcome = run_runtime(request)
    agents = {a["name"]: a for a in outcome.events[0]["agents"]}
    assert set(agents) == {"manager", "librarian"}
    assert agents["manager"]["managed_agents"] == ["librarian"]
    assert "lookup_landmark" in agents["librarian"]["tools"]
    for agent in agents.values():
        assert agent["kind"] == "CodeAgent"
        assert {"json", "base64"} <= set(agent["authorized_imports"])
        assert "os" not in agent["authorized_imports"]
        assert agent["max_steps"] == 3


def test_tool_print_goes_to_stderr_not_to_the_events() -> None:
    outcome = run_runtime(build_request(REPO / "agent_payloads" / "research_team"))
    assert "[knowledge base] lookup 'Eiffel Tower'" in outcome.stderr
    assert "[knowledge base]" not in outcome.stdout


def test_stray_output_of_every_kind_goes_to_stderr() -> None:
    outcome = run_runtime(build_request(TEST_PAYLOADS / "noisy"))
    assert outcome.returncode == 0
    assert "NOISE" not in outcome.stdout
    for noise in ("import-time print", "print from a tool", "sys.stdout.write", "os.write to fd 1"):
        assert f"NOISE {noise}" in outcome.stderr
    assert "NOISE child process" in outcome.stderr
    assert outcome.end["answer"] == "quiet events"


# --- the inner executor's guard ------------------------------------------------------------


def test_forbidden_imports_are_refused_as_step_errors() -> None:
    outcome = run_runtime(build_request(TEST_PAYLOADS / "forbidden_import"))
    steps = outcome.of_type("step")
    assert "Import of os is not allowed" in steps[0]["error"]["message"]
    assert "Import of subprocess is not allowed" in steps[1]["error"]["message"]
    assert steps[2]["error"] is None and steps[2]["is_final_answer"]
    assert outcome.end["state"] == "success"
    assert outcome.end["answer"] == "both imports were refused"


@pytest.mark.parametrize("module", ["os", "os.path", "subprocess", "*", "socket.*", "_io"])
def test_dangerous_authorized_import_is_refused_with_exit_2(module: str) -> None:
    request = build_request(REPO / "agent_payloads" / "research_team")
    request["authorized_imports"] = ["json", module]
    outcome = run_runtime(request)
    assert outcome.returncode == 2
    assert [e["type"] for e in outcome.events] == ["error", "run_end"]
    assert outcome.events[0]["stage"] == "request"
    assert module in outcome.events[0]["error"]["message"]
    assert outcome.end["state"] == "error" and outcome.end["error"]["kind"] == "payload"


def test_allow_dangerous_imports_lets_the_agent_import_them() -> None:
    request = build_request(
        TEST_PAYLOADS / "forbidden_import",
        authorized_imports=["os", "json"],
        allow_dangerous_imports=True,
    )
    outcome = run_runtime(request)
    steps = outcome.of_type("step")
    assert steps[0]["error"] is None and "bin" in steps[0]["observations"]


def test_remote_executor_types_still_run_locally_with_managed_agents() -> None:
    outcome = run_runtime(build_request(TEST_PAYLOADS / "remote_executor"))
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    assert outcome.end["answer"] == 144
    assert [e["agent"] for e in outcome.of_type("managed_agent_call")] == ["helper"]


# --- secrets -------------------------------------------------------------------------------


def secret_forms(value: str) -> list[str]:
    forms = [value, base64.b64encode(value.encode()).decode()]
    forms += [line.strip() for line in value.splitlines()]
    # What the payload prints: the secret inside longer base64 blobs, either alphabet.
    inner = base64.b64encode(("x" + value + "tail").encode()).decode()
    inner_urlsafe = base64.urlsafe_b64encode(("yz" + value).encode()).decode()
    forms += [inner[4:-8], inner_urlsafe[4:-4]]
    return forms


def test_secrets_are_masked_in_every_event_and_in_result_path(tmp_path: Path) -> None:
    result_path = tmp_path / "out" / "result.json"
    request = build_request(
        TEST_PAYLOADS / "leaky", secrets={"LEAKY_SECRET": SECRET}, result_path=str(result_path)
    )
    outcome = run_runtime(request)
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    # The tool really got the secret from the environment (it printed it to stderr).
    assert "read_secret: correct-horse-battery" in outcome.stderr
    printed = outcome.of_type("step")[0]["observations"].splitlines()[1:-2]
    assert len(printed) == 7, printed  # 4 encodings and 3 lines, each of them masked
    assert all("***" in line for line in printed), printed
    assert outcome.end["answer"].count("***") >= 1
    written = result_path.read_text()
    for form in secret_forms(SECRET):
        assert form not in outcome.stdout, f"secret form leaked: {form!r}"
        assert form not in written
    assert json.loads(written) == outcome.end


def test_example_secret_is_available_to_tools_and_checked() -> None:
    folder = REPO / "agent_payloads" / "data_analyst"
    with_token = run_runtime(build_request(folder))
    receipts = [s["observations"] for s in with_token.of_type("step") if s["agent"] == "manager"]
    assert any("receipt rpt-" in (o or "") for o in receipts)
    assert EXAMPLE_SECRET not in with_token.stdout

    without = run_runtime(build_request(folder, secrets={}))
    errors = [s["error"]["message"] for s in without.of_type("step") if s["error"]]
    assert any("ANALYTICS_TOKEN is not set" in m for m in errors)


# --- failures ------------------------------------------------------------------------------


def test_exhausted_mock_script_of_the_manager_fails_clearly() -> None:
    folder = REPO / "agent_payloads" / "research_team"
    scripts = manifest_of(folder)["mock"]["scripts"]
    outcome = run_runtime(build_request(folder, mock_scripts={**scripts, "manager": []}))
    assert outcome.returncode == 1
    end = outcome.end
    assert end["state"] == "error" and end["error"]["kind"] == "agent"
    assert "mock script of agent 'manager' is exhausted" in end["error"]["message"]
    error = outcome.of_type("error")[0]
    assert error["stage"] == "model" and "exhausted" in error["error"]["message"]
    assert outcome.of_type("step")[-1]["error"]["type"] == "AgentGenerationError"


def test_exhausted_mock_script_of_a_managed_agent_is_a_step_error_of_its_caller() -> None:
    folder = REPO / "agent_payloads" / "research_team"
    scripts = manifest_of(folder)["mock"]["scripts"]
    short = {**scripts, "librarian": scripts["librarian"][:1]}  # its step 1 fails: 2 is missing
    outcome = run_runtime(build_request(folder, mock_scripts=short))
    result = outcome.of_type("managed_agent_result")[0]
    assert "mock script of agent 'librarian' is exhausted" in result["error"]["message"]
    manager_steps = [s for s in outcome.of_type("step") if s["agent"] == "manager"]
    assert "librarian" in manager_steps[0]["error"]["message"]


def test_exhausted_mock_script_names_the_step_error_that_caused_it() -> None:
    """A script that runs out because a step failed reports that failure first."""
    folder = REPO / "agent_payloads" / "research_team"
    scripts = manifest_of(folder)["mock"]["scripts"]
    broken = ["Thought: typo.\n<code>\nprint(undefined_name_42)\n</code>"]
    outcome = run_runtime(build_request(folder, mock_scripts={**scripts, "manager": broken}))
    message = outcome.end["error"]["message"]
    assert "agent 'manager' failed: AgentExecutionError" in message
    assert "undefined_name_42" in message and "is exhausted" in message
    assert message.index("undefined_name_42") < message.index("is exhausted")


def test_max_steps_error_ends_with_exit_1() -> None:
    outcome = run_runtime(build_request(TEST_PAYLOADS / "forbidden_import", max_steps=1))
    assert outcome.returncode == 1
    assert outcome.end["state"] == "max_steps_error"
    assert outcome.end["error"]["type"] == "AgentMaxStepsError"
    assert not outcome.of_type("final_answer")


def test_result_path_gets_the_run_end(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    outcome = run_runtime(
        build_request(REPO / "agent_payloads" / "research_team", result_path=str(path))
    )
    assert json.loads(path.read_text()) == outcome.end
    assert outcome.end["type"] == "run_end" and outcome.end["state"] == "success"


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"not json", "not one UTF-8 JSON object"),
        (b"[1, 2]", "one JSON object"),
        (json.dumps({"protocol": 2}).encode(), "unsupported protocol"),
    ],
)
def test_bad_request_exits_2(raw: bytes, needle: str) -> None:
    outcome = run_runtime(raw, fresh=True)
    assert outcome.returncode == 2
    assert needle in outcome.events[0]["error"]["message"]
    assert outcome.end["state"] == "error"


def test_preload_takes_a_model_client_and_nothing_else() -> None:
    """`--preload openai` imports the client ahead and the run goes on as usual; any other
    module (or a stray argument) is a bad command line, reported as a bad request."""
    request = build_request(REPO / "agent_payloads" / "research_team")
    ran = run_runtime(request, args=("--preload", "openai"), fresh=True)
    assert ran.end["state"] == "success", ran.stderr[-2000:]
    for args in (("--preload", "os"), ("--preload",), ("--preload", "openai", "extra")):
        refused = run_runtime(request, args=args, fresh=True)
        assert refused.returncode == 2, args
        assert "unexpected arguments" in refused.events[0]["error"]["message"], args


def test_bad_entrypoint_is_a_payload_error() -> None:
    folder = REPO / "agent_payloads" / "research_team"
    request = build_request(folder)
    request["payload"]["entrypoint"] = "team:no_such_function"
    outcome = run_runtime(request)
    assert outcome.returncode == 2
    assert outcome.events[0]["stage"] == "payload"
    assert "no_such_function" in outcome.events[0]["error"]["message"]
    assert outcome.end["error"]["kind"] == "payload"


def test_payload_file_outside_its_folder_is_refused() -> None:
    request = build_request(REPO / "agent_payloads" / "research_team")
    request["payload"]["files"]["../escape.py"] = "print('x')"
    outcome = run_runtime(request)
    assert outcome.returncode == 2
    assert "outside the payload folder" in outcome.events[0]["error"]["message"]


# --- model endpoint failures ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def http_status_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """A local endpoint that answers every POST with the parametrized HTTP status."""
    status = request.param

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's naming
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps({"error": f"status {status}"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(  # a quick shutdown(): see tests/model_server.py
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def hf_request(api_base: str) -> dict[str, Any]:
    model = {
        "provider": "hf",
        "model_id": "some/model",
        "api_base": api_base,
        "credential_env": "HF_TOKEN",
        "options": {"retry": False},
    }
    return build_request(
        REPO / "agent_payloads" / "research_team",
        model=model,
        secrets={"HF_TOKEN": "hf_secret_token_value"},
    )


def test_unreachable_model_endpoint_is_model_unavailable() -> None:
    outcome = run_runtime(hf_request(f"http://127.0.0.1:{free_port()}"))
    assert outcome.returncode == 1
    assert outcome.end["state"] == "error"
    assert outcome.end["error"]["kind"] == "model_unavailable"


@pytest.mark.parametrize(
    "http_status_server, kind",
    [(503, "model_unavailable"), (429, "model_unavailable"), (400, "agent")],
    indirect=["http_status_server"],
)
def test_http_status_of_the_model_endpoint_is_classified(http_status_server: str, kind: str):
    outcome = run_runtime(hf_request(http_status_server))
    assert outcome.returncode == 1
    assert outcome.end["error"]["kind"] == kind
    assert "hf_secret_token_value" not in outcome.stdout


def openai_request(api_base: str, **overrides: Any) -> dict[str, Any]:
    model = {
        "provider": "openai",
        "model_id": "scripted-gpt",
        "api_base": api_base,
        "credential_env": "OPENAI_API_KEY",
        "options": {"retry": False, "client_kwargs": {"max_retries": 0}},
    }
    return build_request(
        TEST_PAYLOADS / "forbidden_import",
        model=model,
        secrets={"OPENAI_API_KEY": "sk-test-secret-key-123"},
        **overrides,
    )


@pytest.mark.parametrize(
    "http_status_server, kind",
    [(503, "model_unavailable"), (429, "model_unavailable"), (401, "agent")],
    indirect=["http_status_server"],
)
def test_openai_endpoint_failures_are_classified(http_status_server: str, kind: str) -> None:
    pytest.importorskip("openai")
    outcome = run_runtime(openai_request(http_status_server + "/v1"))
    assert outcome.returncode == 1
    assert outcome.end["error"]["kind"] == kind


def test_openai_unreachable_endpoint_is_model_unavailable() -> None:
    pytest.importorskip("openai")
    outcome = run_runtime(openai_request(f"http://127.0.0.1:{free_port()}/v1"))
    assert outcome.end["error"]["kind"] == "model_unavailable"


def test_openai_provider_plays_a_scripted_server_over_http() -> None:
    """The real network path: OpenAIServerModel talks to a local chat-completions server."""
    pytest.importorskip("openai")
    outputs = manifest_of(TEST_PAYLOADS / "forbidden_import")["mock"]["scripts"]["manager"]
    seen: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"auth": self.headers.get("Authorization"), "body": body})
            text = outputs[len(seen) - 1]
            reply = json.dumps(
                {
                    "id": f"c{len(seen)}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107},
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api_base = f"http://127.0.0.1:{server.server_address[1]}/v1"
        outcome = run_runtime(openai_request(api_base, mock_scripts={}))
    finally:
        server.shutdown()
        server.server_close()
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    assert outcome.end["answer"] == "both imports were refused"
    assert len(seen) == 3 and all(s["body"]["model"] == "scripted-gpt" for s in seen)
    assert seen[0]["auth"] == "Bearer sk-test-secret-key-123"
    assert outcome.end["token_usage"] == {"input_tokens": 300, "output_tokens": 21}
    assert outcome.events[0]["model"] == {"provider": "openai", "model_id": "scripted-gpt"}


def test_planning_steps_and_tool_calling_managed_agents_are_reported() -> None:
    code = (
        "from smolagents import CodeAgent, ToolCallingAgent\n\n"
        "def build(model):\n"
        "    helper = ToolCallingAgent([], model, name='helper', description='Greets.')\n"
        "    return CodeAgent([], model, managed_agents=[helper], planning_interval=5)\n"
    )
    request = build_request(
        TEST_PAYLOADS / "forbidden_import",
        payload={"name": "inline", "entrypoint": "inline:build", "files": {"inline.py": code}},
        mock_scripts={
            "manager": [
                "1. Ask the helper. 2. Return its answer.",
                "<code>\nreply = helper(task='Say hi.')\n</code>",
                "<code>\nfinal_answer(reply)\n</code>",
            ],
            "helper": ['Action: {"name": "final_answer", "arguments": {"answer": "hi there"}}'],
        },
    )
    outcome = run_runtime(request)
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    steps = outcome.of_type("step")
    assert steps[0]["step_type"] == "planning" and steps[0]["agent"] == "manager"
    assert "Ask the helper" in steps[0]["model_output"]
    helper_steps = [s for s in steps if s["agent"] == "helper"]
    assert helper_steps and helper_steps[0]["is_final_answer"]
    # The ToolCallingAgent's call as smolagents read it; the CodeAgent's is its code.
    (call,) = helper_steps[0]["tool_calls"]
    assert (call["name"], call["arguments"]) == ("final_answer", {"answer": "hi there"})
    assert [s["tool_calls"] for s in steps if s["agent"] == "manager"] == [None, None, None]
    assert outcome.of_type("managed_agent_result")[0]["output"].endswith("hi there")


def test_a_run_refuses_before_its_first_step_what_a_check_refuses() -> None:
    """A run whose loaded tree fails `validate`'s checks (a mock script keyed
    for no agent, an agent's declared import the run does not grant) ends at once with the
    same problems, exit 2, no step and no model call (before: the run went on)."""
    folder = REPO / "agent_payloads" / "research_team"
    scripts = manifest_of(folder)["mock"]["scripts"]
    misspelled = {"manager": scripts["manager"], "librarain": scripts["librarian"]}
    checked = run_runtime(build_request(folder, mock_scripts=misspelled, check_only=True))
    ran = run_runtime(build_request(folder, mock_scripts=misspelled))
    assert checked.returncode == ran.returncode == 2
    assert ran.end["error"]["kind"] == "payload"
    problems = ran.end["error"]["problems"]
    assert problems == checked.end["error"]["problems"]
    assert any("mock script for 'librarain', which is not an agent" in p for p in problems)
    assert [e["type"] for e in ran.events] == ["run_start", "run_end"]
    assert ran.end["token_usage"] == {"input_tokens": 0, "output_tokens": 0}
    web = REPO / "agent_payloads" / "web_browser"
    ungranted = run_runtime(build_request(web, authorized_imports=["numpy"]))
    assert ungranted.returncode == 2 and not ungranted.of_type("step")
    assert "pandas" in ungranted.end["error"]["message"]


def test_plans_in_a_mock_script_are_free_text() -> None:
    """Only action outputs need a code block: an agent with `planning_interval` plans before
    step 1 and every interval steps (its top-level script is checked to the step); a
    managed one may be called again at any step, so only its first action is sure."""
    from smolagents import CodeAgent

    from orchestrator_runtime.models import action_outputs, script_problems

    agent = CodeAgent(tools=[], model=None, planning_interval=2, max_steps=4)
    assert action_outputs(agent, 9) == [1, 2, 4, 5]  # plan, 1, 2, plan, 3, 4 (+ free text)
    assert action_outputs(agent, 9, top=False) == [1]
    code = "<code>\nfinal_answer(1)\n</code>"
    script = ["a plan", code, code, "an updated plan", code, code]
    assert script_problems("manager", agent, script) == []
    (problem,) = script_problems("manager", agent, ["a plan", "no code here"])
    assert "output 2 of 2: no code block" in problem
    plain = CodeAgent(tools=[], model=None, max_steps=2)
    assert action_outputs(plain, 5) == [0, 1]


# --- the program's own settings -------------------------------------------------


def test_agents_keep_their_own_max_steps_unless_the_manifest_or_the_run_sets_one() -> None:
    folder = REPO / "agent_payloads" / "web_browser"
    own = run_runtime(build_request(folder, max_steps=10, max_steps_from="program"))
    assert own.returncode == 0, own.stderr[-3000:]
    agents = {a["name"]: a for a in own.events[0]["agents"]}
    assert agents["manager"]["max_steps"] == 20  # smolagents' default, the program's
    assert agents["web_search_agent"]["max_steps"] == 10  # its own max_steps=10
    assert {a["max_steps_from"] for a in agents.values()} == {"program"}

    capped = run_runtime(build_request(folder, max_steps=4, max_steps_from="run"))
    agents = {a["name"]: a for a in capped.events[0]["agents"]}
    assert agents["manager"]["max_steps"] == agents["web_search_agent"]["max_steps"] == 4
    assert {a["max_steps_from"] for a in agents.values()} == {"run"}


def test_the_record_says_which_imports_an_agent_declared_and_which_it_was_not_granted() -> None:
    folder = REPO / "agent_payloads" / "web_browser"
    outcome = run_runtime(build_request(folder, authorized_imports=["numpy"], check_only=True))
    agents = {a["name"]: a for a in outcome.events[0]["agents"]}
    manager = agents["manager"]
    assert manager["declared_imports"] == ["time", "numpy", "pandas"]
    assert manager["imports_not_granted"] == ["pandas"]  # time is always allowed
    assert (
        "numpy" in manager["authorized_imports"] and "pandas" not in manager["authorized_imports"]
    )
    assert agents["web_search_agent"]["declared_imports"] is None  # not a CodeAgent
    assert outcome.returncode == 2
    (problem,) = outcome.end["error"]["problems"]
    assert "'manager'" in problem and "pandas" in problem and "python.authorized_imports" in problem


def test_an_import_the_image_lacks_names_the_line_and_the_requirement(tmp_path: Path) -> None:
    """A payload's `import X` of a package not in its image says where and
    what to do (add it to `[python] requirements`), not a bare ModuleNotFoundError."""
    folder = tmp_path / "needs_a_package"
    shutil.copytree(TEST_PAYLOADS / "forbidden_import", folder)
    module = manifest_of(folder)["payload"]["entrypoint"].split(":")[0]
    source = folder / f"{module}.py"
    source.write_text("import json\nimport tabulatr_nonexistent\n" + source.read_text())
    outcome = run_runtime(build_request(folder))
    assert outcome.returncode == 2, outcome.stderr[-2000:]
    error = outcome.end["error"]
    assert error["type"] == "PayloadError", error
    assert f"{module}.py, line 2: `import tabulatr_nonexistent`" in error["message"], error
    assert "`[python] requirements` in manifest.toml" in error["message"], error
