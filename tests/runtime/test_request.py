"""The run request is defined once (orchestrator_runtime/request.py): what the host builds and
a backend ships is what the runtime parses, field for field, and docs/PROTOCOL.md describes
every field of it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any

import pytest

from orchestrator.lifecycle.runner import build_request, prepare
from orchestrator.spec import RunSpec
from orchestrator_runtime.protocol import PROTOCOL_VERSION
from orchestrator_runtime.request import Request, RequestError, parse_request, wire_fields
from tests.conftest import REPO

PROTOCOL_DOC = REPO / "docs" / "PROTOCOL.md"


def default_of(name: str) -> Any:
    """A field's default, or MISSING for a required one."""
    (item,) = (f for f in fields(Request) if f.name == name)
    if item.default_factory is not MISSING:
        return item.default_factory()
    return item.default


def request_with_every_field(monkeypatch: pytest.MonkeyPatch) -> Request:
    """What the host builds for an HTTP model (through `prepare` and `build_request`), with
    the parts a backend adds, and no field left at its default."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-in-the-environment")
    prepared = prepare(
        RunSpec(
            payload=REPO / "agent_payloads" / "research_team",
            task="What opened first?",
            model="openai:gpt-4o-mini",
            api_base="http://127.0.0.1:9/v1",
            model_key_env="OPENAI_API_KEY",
            model_options={"temperature": 0.5, "client_kwargs": {"max_retries": 0}},
            gateway=False,
            additional_args={"a": 3, "nested": [1, {"b": None}]},
            allow_dangerous_imports=True,
            max_steps=7,
            check_only=True,
        )
    )
    built = build_request(prepared)
    assert isinstance(built, Request)
    return replace(
        built,
        # the host sends mock scripts for the mock model only; the wire carries them for any
        mock_scripts={"manager": ["Thought: a\n<code>\nfinal_answer(1)\n</code>"]},
        files={**built.files, "data/blob.bin": {"base64": "AAH/"}},
        secrets={"WEATHER_API_KEY": "w-secret\nwith a newline"},  # the Docker backend's part
        secret_env=["OPENAI_API_KEY"],  # the E2B backend's part
        rlimits={"nproc": 256, "nofile": 1024, "core": 0},
        # the host's part when tracing is on (traces.trace_request)
        trace={
            "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
            "parent_span_id": "00f067aa0ba902b7",
        },
        # with bound secrets: the intercepting proxy's CA (its certificate only)
        trust_ca="-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
        # a program's endpoint variables, and a Bedrock model's region (not secret)
        endpoint_env=["OPENAI_BASE_URL"],
        model_env={"AWS_REGION": "us-east-1"},
    )


def test_a_host_built_request_comes_back_equal_from_its_json(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request = request_with_every_field(monkeypatch)
    unset = [f.name for f in fields(Request) if getattr(request, f.name) == default_of(f.name)]
    # A payload's request; a program's sets these (test_a_programs_request_comes_back_equal).
    assert unset == list(PROGRAM_FIELDS), "set every field, so that the round trip covers it"
    raw = request.to_json().encode()
    data = json.loads(raw)
    assert data["protocol"] == PROTOCOL_VERSION
    assert data["payload"]["name"] == "research_team"
    assert data["model"]["credential_env"] == "OPENAI_API_KEY"
    assert parse_request(data) == request


def test_a_backend_leaves_out_the_parts_it_does_not_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """Docker's stdin has no `secret_env` or `rlimits`; E2B's uploaded file no `secrets` key
    at all (their values are in the runtime command's environment only)."""
    request = replace(request_with_every_field(monkeypatch), secrets={}, secret_env=[], rlimits={})
    docker = json.loads(replace(request, secrets={"A": "value-a"}).to_json())
    assert docker["secrets"] == {"A": "value-a"}
    assert "secret_env" not in docker and "rlimits" not in docker
    e2b = json.loads(replace(request, secret_env=["A"], rlimits={"nproc": 9}).to_json())
    assert "secrets" not in e2b and e2b["secret_env"] == ["A"] and e2b["rlimits"] == {"nproc": 9}
    assert "value-a" not in json.dumps(e2b)


def test_the_runtime_takes_the_secrets_named_in_secret_env_from_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request = request_with_every_field(monkeypatch)
    assert request.secret_values() == {
        "WEATHER_API_KEY": "w-secret\nwith a newline",
        "OPENAI_API_KEY": "sk-in-the-environment",
    }
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(RequestError, match="`OPENAI_API_KEY` named in secret_env is not in"):
        parse_request(json.loads(request.to_json()))


@pytest.mark.parametrize(
    "where, value",
    [(None, "surprise"), ("payload", "version"), ("model", "temperature")],
)
def test_an_unknown_field_is_refused(where: str | None, value: str) -> None:
    """Stricter than a plain JSON reader: a field this runtime does not know (a newer host's
    limit, say) is never silently dropped."""
    data = json.loads(minimal_request().to_json())
    (data[where] if where else data)[value] = 1
    dotted = f"{where}.{value}" if where else value
    with pytest.raises(RequestError, match=f"unknown request field `{dotted}`"):
        parse_request(data)
    outcome = subprocess.run(
        [sys.executable, "-m", "orchestrator_runtime"],
        input=json.dumps(data).encode(),
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    assert outcome.returncode == 2, outcome.stderr[-2000:]
    events = [json.loads(line) for line in outcome.stdout.splitlines()]
    assert [e["type"] for e in events] == ["error", "run_end"]
    assert f"unknown request field `{dotted}`" in events[0]["error"]["message"]


def minimal_request() -> Request:
    return Request(
        run_id="r-test-minimal",
        task="Say hi.",
        payload_name="p",
        entrypoint="team:build",
        files={"team.py": "def build(model): ...\n"},
        provider="mock",
    )


# --- the document ---------------------------------------------------------------------------


def request_section() -> str:
    text = PROTOCOL_DOC.read_text(encoding="utf-8")
    start = text.index("### The request (stdin)")
    return text[start : text.index("\n## ", start)]


def example_of(section: str) -> dict[str, Any]:
    match = re.search(r"```json\n(.*?)\n```", section, re.DOTALL)
    assert match, "the request section shows the request as a JSON example"
    return json.loads(match.group(1))


def test_every_field_of_the_request_is_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/PROTOCOL.md cannot drift from the class: its example holds exactly the request's
    fields (and parses), and its prose names each one."""
    section = request_section()
    example = example_of(section)
    places = set(wire_fields().values())
    shown = set()
    for key, value in example.items():
        inner = value if key in ("payload", "model") else {}
        shown |= {f"{key}.{name}" for name in inner} if inner else {key}
    assert shown == places | {"protocol"}
    prose = section[section.index("```", section.index("```json") + 3) :]
    undocumented = sorted(place for place in places if f"`{place}`" not in prose)
    assert undocumented == [], f"docs/PROTOCOL.md's prose does not describe {undocumented}"
    monkeypatch.setenv("OPENAI_API_KEY", "sk-example")
    parsed = parse_request(example)
    assert json.loads(parsed.to_json()) == example


#: The request's fields only a program sets.
PROGRAM_FIELDS = ("program", "argv", "requires_python", "model_source")


def test_a_programs_request_comes_back_equal_from_its_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A program's request keeps its own fields on the round trip: the program,
    its arguments, its requires-python, the variable its endpoint is read from and its own
    models as the model source."""
    monkeypatch.setenv("HF_TOKEN", "hf-in-the-environment")
    monkeypatch.setenv("TEAM_BASE", "http://127.0.0.1:9/v1")
    program = tmp_path / "team.py"
    program.write_text(
        '# /// script\n# requires-python = ">=3.10"\n# ///\n'
        "import os\nfrom smolagents import CodeAgent, OpenAIServerModel\n"
        "model = OpenAIServerModel('m', api_base=os.getenv('TEAM_BASE'),"
        " api_key=os.getenv('HF_TOKEN'))\n"
        "agent = CodeAgent(tools=[], model=model)\n"
        "agent.run('hi')\n"
    )
    prepared = prepare(
        RunSpec(
            payload=program,
            program_args=("--verbose", "x"),
            task="replaced",
            gateway=False,
        )
    )
    request = replace(build_request(prepared), secret_env=["HF_TOKEN"])  # the backend's part
    assert [getattr(request, name) for name in PROGRAM_FIELDS] == [
        "team.py",
        ["--verbose", "x"],
        ">=3.10",
        "program",
    ]
    assert request.endpoint_env == ["TEAM_BASE"]
    assert request.api_base.endswith(":9/v1")  # TEAM_BASE read on the host, as the program would
    assert (request.entrypoint, request.provider, request.credential_env) == (
        "",
        "openai",
        "HF_TOKEN",
    )
    assert parse_request(json.loads(request.to_json())) == request


@pytest.mark.parametrize(
    ("trust_ca", "said"),
    [
        ("not a certificate", "must be PEM certificates"),
        (
            "-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----\n"
            "-----BEGIN PRIVATE KEY-----\nB\n-----END PRIVATE KEY-----",
            "must be PEM certificates",
        ),
        (
            "-----BEGIN CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\n-----END CERTIFICATE-----",
            "never a key",
        ),
    ],
)
def test_the_runs_ca_is_certificates_only(
    monkeypatch: pytest.MonkeyPatch, trust_ca: str, said: str
) -> None:
    data = json.loads(replace(request_with_every_field(monkeypatch), trust_ca=trust_ca).to_json())
    with pytest.raises(RequestError, match=said):
        parse_request(data)
