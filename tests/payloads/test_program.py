"""Programs as their authors wrote them: `orchestrator run program.py`.

The runtime's part runs here in a local subprocess (fast: the hold, the ends, the answer, the
record of each agent); the host's part (PEP 723 metadata, the model read from the source,
refusals before anything starts) without a sandbox; and the whole path, gateway included,
against the real engine with the scripted model server.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import pytest

from orchestrator import RunSpec
from orchestrator.errors import ConfigError, ManifestError
from orchestrator.lifecycle.runner import build_request, prepare
from orchestrator.payloads.manifest import load_manifest
from orchestrator.payloads.program import SMOLAGENTS_EXTRAS, image_smolagents
from tests.conftest import REPO, cli
from tests.model_server import ScriptedModelServer
from tests.runtime.test_runtime import RuntimeExit, free_port, run_runtime

PROGRAMS = REPO / "tests" / "programs"
FIB_TEAM = PROGRAMS / "fib_team.py"


def code(body: str, thought: str = "I will do it.") -> str:
    """One CodeAgent step as a model writes it."""
    return f"Thought: {thought}\n<code>\n{body}\n</code>"


def program_request(path: Path, scripts: dict[str, list[str]], **payload: Any) -> dict[str, Any]:
    """A runtime request for a program, as the host builds it (mock model)."""
    spec = RunSpec(payload=path, model="mock", program_args=tuple(payload.pop("argv", ())))
    request = json.loads(build_request(prepare(spec)).to_json())
    request["mock_scripts"] = scripts
    request["result_path"] = None
    request["payload"].update(payload)
    return request


# ---- the runtime: a program run as __main__, its agents held ---------------------------------


def test_two_top_level_runs_answer_with_the_last_and_are_both_recorded() -> None:
    scripts = {
        "first": [code("final_answer(1 + 2)")],
        "manager": [code("final_answer(6 * 7)")],
    }
    out = run_runtime(program_request(PROGRAMS / "two_runs.py", scripts, argv=["a", "-b"]))
    assert out.returncode == 0, out.stderr
    assert out.end["state"] == "success" and out.end["answer"] == 42
    runs = out.of_type("agent_run")
    assert [(r["agent"], r["task"], r["first"]) for r in runs] == [
        ("first", "Add 1 and 2.", True),
        ("manager", "Multiply 6 and 7.", False),
    ]
    answers = [(e["agent"], e["answer"]) for e in out.of_type("final_answer")]
    assert answers == [("first", 3), ("manager", 42)]
    # The program's prints are its logs (stderr), never the event stream.
    assert "first says 3" in out.stderr and "second says 42" in out.stderr
    assert "argv ['a', '-b']" in out.stderr
    start = out.of_type("run_start")[0]
    assert start["program"] == {"path": "two_runs.py", "argv": ["a", "-b"]}
    assert [a["name"] for a in start["agents"]] == ["first"]
    (tree,) = out.of_type("agent_tree")
    (second,) = tree["agents"]
    # Asked for E2B inside the sandbox: the local executor runs, and the record says so.
    assert second["executor"] == {"asked": "e2b", "runs": "local"}
    assert second["model"]["class"] == "InferenceClientModel"
    assert second["model"]["source"] == "mock" and second["model"]["runs"] == "ScriptedModel"
    # run(max_steps=999) does not lift the cap: each agent kept smolagents' own 20.
    assert second["max_steps"] == 20


def test_an_uncaught_exception_fails_the_run_with_its_traceback() -> None:
    out = run_runtime(
        program_request(PROGRAMS / "raises.py", {"manager": [code("final_answer('hi')")]})
    )
    assert out.returncode == 1
    assert out.end["state"] == "error"
    assert out.end["error"]["type"] == "RuntimeError"
    assert out.end["error"]["kind"] == "program"
    assert "gave up after 'hi'" in out.end["error"]["message"]
    (error,) = out.of_type("error")
    assert "raises.py" in error["traceback"] and "RuntimeError" in error["traceback"]
    assert "Traceback (most recent call last)" in out.stderr  # as Python prints it


def test_an_mcp_server_out_of_reach_is_the_programs_error_not_the_models(
    tmp_path: Path,
) -> None:
    """A program whose MCP server cannot be reached (smolagents' MCPClient, mcpadapt: "Couldn't
    connect to the MCP server", a TimeoutError) fails as the program's error, not as
    `model_unavailable`: that would make it an infrastructure fault, retried by a batch and
    explained as the model's endpoint out of reach."""
    program = tmp_path / "remote_tools.py"
    program.write_text(
        "from smolagents import MCPClient\n"
        f"url = 'http://127.0.0.1:{free_port()}/mcp'\n"
        "server = {'url': url, 'transport': 'streamable-http'}\n"
        "with MCPClient(server, adapter_kwargs={'connect_timeout': 2}) as tools:\n"
        "    print(tools)\n"
    )
    out = run_runtime(program_request(program, {}))
    assert out.returncode == 1, out.stderr
    error = out.end["error"]
    assert (error["type"], error["kind"]) == ("TimeoutError", "program"), error
    assert "connect to the MCP server" in error["message"]


@pytest.mark.parametrize("code_", [0, 3])
def test_sys_exit_decides_the_end(code_: int) -> None:
    out = run_runtime(program_request(PROGRAMS / "exits.py", {}, argv=[str(code_)]))
    assert f"exiting with {code_}" in out.stderr
    assert out.of_type("run_start")[0]["agents"] == []  # it ran no agent
    if code_ == 0:
        assert (out.returncode, out.end["state"], out.end["answer"]) == (0, "success", None)
    else:
        assert out.returncode == 1
        assert out.end["error"]["exit_code"] == 3 and out.end["error"]["type"] == "SystemExit"


def test_a_program_that_runs_no_agent_succeeds_without_an_answer() -> None:
    out: RuntimeExit = run_runtime(program_request(PROGRAMS / "no_agent.py", {}))
    assert (out.returncode, out.end["state"], out.end["answer"]) == (0, "success", None)
    assert "nothing to do here" in out.stderr


def test_a_given_task_replaces_the_first_agent_runs_own(tmp_path: Path) -> None:
    program = tmp_path / "asks.py"
    program.write_text(
        "import os\nfrom smolagents import CodeAgent, InferenceClientModel\n"
        "agent = CodeAgent(tools=[], model=InferenceClientModel())\n"
        "print('env task:', os.environ.get('ORCHESTRATOR_TASK'))\n"
        "agent.run('the program\\'s own question')\n"
    )
    request = program_request(program, {"manager": [code("final_answer('ok')")]})
    request["task"] = "the batch's question"
    out = run_runtime(request)
    assert out.returncode == 0, out.stderr
    (first,) = out.of_type("agent_run")
    assert first["task"] == "the batch's question"
    assert first["program_task"] == "the program's own question"  # recorded beside it
    step = out.of_type("step")[0]
    assert step["agent"] == "manager" and out.end["answer"] == "ok"
    assert "env task: the batch's question" in out.stderr


# ---- the host: metadata, models, refusals before anything starts -----------------------------


def test_the_guides_program_reads_as_a_payload_with_its_model() -> None:
    manifest = load_manifest(FIB_TEAM)
    assert (manifest.name, manifest.program, manifest.single_file) == (
        "fib_team",
        "fib_team.py",
        True,
    )
    assert manifest.payload_files().keys() == {"fib_team.py"}  # nothing beside it ships
    uses = manifest.model_uses
    assert [(u.cls, u.line, u.provider, u.key_env) for u in uses] == [
        ("InferenceClientModel", 5, "together", "HF_TOKEN"),
        ("InferenceClientModel", 11, "together", "HF_TOKEN"),
    ]


def test_pep_723_metadata_becomes_the_runs_settings(tmp_path: Path) -> None:
    program = tmp_path / "Report Writer.py"
    program.write_text(
        "# /// script\n"
        '# requires-python = ">=3.10"\n'
        '# dependencies = ["smolagents>=1.20", "sqlalchemy>=2"]\n'
        "# [tool.orchestrator.payload]\n"
        '# model = "mock"\n'
        "# [tool.orchestrator.python]\n"
        '# authorized_imports = ["json"]\n'
        "# [tool.orchestrator.limits]\n"
        "# timeout_seconds = 60\n"
        "# [tool.orchestrator.mock.scripts]\n"
        '# manager = ["Thought: x"]\n'
        "# ///\n"
        "print('hi')\n"
    )
    manifest = load_manifest(program)
    assert manifest.name == "report-writer"
    assert manifest.requirements == ("sqlalchemy>=2",)  # the image's own smolagents stays
    assert manifest.requires_python == ">=3.10"
    assert manifest.authorized_imports == ("json",)
    assert manifest.limits.timeout_seconds == 60
    assert manifest.mock_scripts == {"manager": ["Thought: x"]}
    prepared = prepare(RunSpec(payload=program))
    assert prepared.model.provider == "mock" and prepared.image_requirements == ("sqlalchemy>=2",)


def test_bad_metadata_is_refused_with_its_line(tmp_path: Path) -> None:
    program = tmp_path / "bad.py"
    program.write_text(
        "import os\n"
        "# /// script\n"
        '# dependencies = ["smolagents>=9"]\n'
        "# [tool.orchestrator.payload]\n"
        '# entrypoint = "a:b"\n'
        "# [tool.orchestrator.limits]\n"
        "# max_stepz = 3\n"
        "# ///\n"
    )
    with pytest.raises(ManifestError) as caught:
        load_manifest(program)
    text = str(caught.value)
    assert "line 3" in text and "smolagents 1.26.0" in text
    assert "line 5" in text and "entrypoint" in text
    assert "line 7" in text and "max_steps" in text  # did you mean


def test_smolagents_extras_are_installed_at_the_images_version(tmp_path: Path) -> None:
    """`smolagents[mcp]` keeps its extras (their packages resolved with the program's
    others), at the image's smolagents: the image's own is never replaced."""
    program = tmp_path / "tools.py"
    program.write_text(
        "# /// script\n"
        "# dependencies = [\"smolagents[MCP, toolkit]>=1.20; python_version >= '3.10'\", "
        '"tabulate", "smolagents"]\n'
        "# ///\n"
        "print('hi')\n"
    )
    manifest = load_manifest(program)
    assert manifest.requirements == (
        f'smolagents[mcp,toolkit]=={image_smolagents()}; python_version >= "3.10"',
        "tabulate",
    )


def test_an_extra_smolagents_lacks_is_refused_naming_those_it_has(tmp_path: Path) -> None:
    program = tmp_path / "tools.py"
    program.write_text('# /// script\n# dependencies = ["smolagents[mcpp]"]\n# ///\n')
    result = cli("validate", str(program))
    assert result.returncode == 2, result.stderr
    assert f"{program}:2: field `dependencies` has 'smolagents[mcpp]'" in result.stderr
    assert f"smolagents {image_smolagents()} has no extra 'mcpp'" in result.stderr
    assert "(it has all, audio, " in result.stderr and "Did you mean mcp?" in result.stderr


def test_the_extras_listed_are_those_of_the_images_smolagents() -> None:
    """SMOLAGENTS_EXTRAS against smolagents' own metadata (the test environment's
    smolagents, which must be the image's version for the comparison to hold)."""
    import importlib.metadata

    metadata = importlib.metadata.metadata("smolagents")
    assert metadata["Version"] == image_smolagents()
    assert sorted(SMOLAGENTS_EXTRAS) == sorted(metadata.get_all("Provides-Extra") or [])


def test_a_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    program = tmp_path / "broken.py"
    program.write_text("print('ok')\n\ndef f(:\n    pass\n")
    result = cli("validate", str(program))
    assert result.returncode == 2, result.stderr
    assert f"{program}:3" in result.stderr and "syntax error" in result.stderr


def test_a_model_that_cannot_be_routed_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Local weights have no endpoint for the gateway to serve: refused, and the fix says
    what to do (a hosted model in their place, `--model provider:model_id`)."""
    program = tmp_path / "local.py"
    program.write_text(
        "from smolagents import CodeAgent, TransformersModel\n"
        "agent = CodeAgent(tools=[], model=TransformersModel('Qwen/Qwen2.5-0.5B'))\n"
        "agent.run('hi')\n"
    )
    with pytest.raises(ConfigError, match="TransformersModel at .*local.py:2") as refused:
        prepare(RunSpec(payload=program))
    assert "--model provider:model_id" in refused.value.fix
    assert "bedrock" in refused.value.fix and "local weights" in str(refused.value)
    result = cli("run", str(program))
    assert result.returncode == 2 and "cannot serve" in result.stderr
    assert "--model provider:model_id" in result.stderr
    assert "run " not in result.stderr.split("error:")[0]  # no run was started


def test_a_declared_secret_unset_on_the_host_starts_nothing(tmp_path: Path) -> None:
    program = tmp_path / "needs.py"
    program.write_text(
        "# /// script\n# [tool.orchestrator.secrets]\n# required = ['NEEDS_TOKEN_UNSET']\n"
        "# ///\nprint('never')\n"
    )
    result = cli("run", str(program), env={"NEEDS_TOKEN_UNSET": ""})
    assert result.returncode == 2
    assert "NEEDS_TOKEN_UNSET" in result.stderr


# ---- the whole path: the guide's program through the gateway, on the real engine -------------


@pytest.mark.docker
def test_the_guides_program_runs_unchanged_with_its_key_on_the_host() -> None:
    token = f"hf_{secrets.token_hex(16)}"
    outputs = [
        code('report = coder_agent(task="Compute the 20th Fibonacci number.")\nprint(report)'),
        code("a, b = 0, 1\nfor _ in range(19):\n    a, b = b, a + b\nfinal_answer(b)"),
        code("final_answer(6765)"),
    ]
    with ScriptedModelServer(outputs) as server:
        result = cli(
            "run",
            "--api-base",
            server.api_base(),
            "--json",
            str(FIB_TEAM),
            env={"HF_TOKEN": token},
        )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["status"] == "succeeded" and outcome["answer"] == 6765
    # The program's model calls reached the server through the gateway, with the host's key.
    assert len(server.requests) == 3
    assert {r["headers"].get("Authorization") for r in server.requests} == {f"Bearer {token}"}
    assert all(r["body"]["model"].endswith(":together") for r in server.requests)
    assert outcome["token_usage_source"] == "gateway"
    assert outcome["gateway"]["key_from"] == "HF_TOKEN"  # the key by name, never its value
    assert token not in result.stdout
    assert {k: outcome["token_usage"][k] for k in server.usage} == server.usage
    record = Path(outcome["record_dir"])
    assert "6765" in (record / "stderr.log").read_text()  # its print, in its logs
    assert "6765" in outcome["output"]  # and in --json
    events = [json.loads(line) for line in (record / "events.jsonl").read_text().splitlines()]
    kinds = [
        (e["type"], e.get("agent"))
        for e in events
        if e["type"] in ("step", "managed_agent_call", "managed_agent_result")
    ]
    assert kinds == [
        ("managed_agent_call", "coder_agent"),
        ("step", "coder_agent"),
        ("managed_agent_result", "coder_agent"),
        ("step", "manager"),
        ("step", "manager"),
    ]
    start = next(e for e in events if e["type"] == "run_start")
    models = {a["name"]: a["model"] for a in start["agents"]}
    assert models["manager"]["class"] == "InferenceClientModel"
    assert models["manager"]["provider"] == "together"
    assert models["coder_agent"]["routed_to"] == "gateway"


@pytest.mark.docker
def test_no_process_in_the_sandbox_holds_the_key() -> None:
    token = f"hf_{secrets.token_hex(16)}"
    with ScriptedModelServer([code("final_answer('done')")]) as server:
        result = cli(
            "run",
            "--api-base",
            server.api_base(),
            "--json",
            str(PROGRAMS / "env_probe.py"),
            env={"HF_TOKEN": token},
        )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    logs = (Path(outcome["record_dir"]) / "stderr.log").read_text()
    hashes = {line.split()[1] for line in logs.splitlines() if line.startswith("env-sha256 ")}
    assert len(hashes) > 5  # it read the environments it could
    assert hashlib.sha256(token.encode()).hexdigest() not in hashes
    assert server.requests[0]["headers"]["Authorization"] == f"Bearer {token}"


# ---- batch: each task replaces the program's own question ------------------------------------


def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def fib_team_answer(body: dict[str, Any]) -> str:
    """What a model would answer the guide's program, from the conversation itself (so that
    tasks run at once): the manager asks coder_agent for the task's number, coder_agent
    computes it, the manager answers with what coder_agent reported."""
    text = json.dumps(body["messages"])
    if "named 'coder_agent'" in text:
        n = int(re.search(r"Compute Fibonacci number (\d+)", text).group(1))  # type: ignore[union-attr]
        return code(f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, a + b\nfinal_answer(a)")
    if len(body["messages"]) > 2:  # the manager, after coder_agent's report
        return code("final_answer(int(str(report).split()[-1]))")
    n = int(re.search(r"What's the (\d+)th Fibonacci number", text).group(1))  # type: ignore[union-attr]
    return code(f'report = coder_agent(task="Compute Fibonacci number {n}.")')


def fib_tasks(path: Path, numbers: list[int]) -> Path:
    """A tasks file asking the guide's question for each number, with its answer."""
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"fib{n}",
                    "task": f"What's the {n}th Fibonacci number?",
                    "expected": str(fibonacci(n)),
                }
            )
            + "\n"
            for n in numbers
        )
    )
    return path


@pytest.mark.docker
def test_a_batch_gives_each_task_to_the_program(tmp_path: Path) -> None:
    numbers = [5, 8, 11, 13, 17, 19, 22, 25, 27, 30]  # not 20, the program's own
    tasks = fib_tasks(tmp_path / "tasks.jsonl", numbers)
    with ScriptedModelServer([], answer=fib_team_answer) as server:
        result = cli(
            "batch",
            str(FIB_TEAM),
            str(tasks),
            "--api-base",
            server.api_base(),
            "--concurrency",
            "4",
            "-o",
            str(tmp_path / "out"),
            "--json",
            env={"HF_TOKEN": f"hf_{secrets.token_hex(8)}"},
            timeout=600,
        )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["counts"]["succeeded"] == 10 and summary["accuracy"] == 1.0
    assert summary["tokens_source"] == "gateway"
    lines = [
        json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    ]
    assert sorted(line["answer"] for line in lines) == sorted(fibonacci(n) for n in numbers)
    # The hard-coded question never reached the model; each task did.
    asked = [json.dumps(r["body"]["messages"]) for r in server.requests]
    assert not any("What's the 20th" in text for text in asked)
    firsts = [t for t in asked if "What's the" in t and "named 'coder_agent'" not in t]
    assert {n for n in numbers if any(f"What's the {n}th" in t for t in firsts)} == set(numbers)
    record = Path(lines[0]["record_dir"])
    events = [json.loads(e) for e in (record / "events.jsonl").read_text().splitlines()]
    run = next(e for e in events if e["type"] == "agent_run")
    assert run["program_task"] == "What's the 20th Fibonacci number?"
    assert run["task"].startswith("What's the ")


# ---- validate ----------------------------------------------------------------------------------


@pytest.mark.docker
def test_validate_loads_a_program_up_to_its_first_agent_run(tmp_path: Path) -> None:
    ok = cli("validate", str(FIB_TEAM), env={"HF_TOKEN": "hf_for_validation"})
    assert ok.returncode == 0, ok.stderr
    assert "program fib_team.py" in ok.stdout and "agents manager, coder_agent" in ok.stdout
    missing = cli("validate", str(FIB_TEAM), env={"HF_TOKEN": ""})
    assert missing.returncode == 2 and "HF_TOKEN" in missing.stderr
    program = typo_program(tmp_path)
    typo = cli("validate", str(program), env={"HF_TOKEN": "hf_for_validation"})
    assert typo.returncode == 2
    assert "mock script for 'reseacher', which is not an agent of the tree" in typo.stderr


def typo_program(tmp_path: Path, scripts: str = "reseacher = ['x']") -> Path:
    """A program of a `researcher` managed by an unnamed manager, with these mock scripts."""
    program = tmp_path / "typo.py"
    program.write_text(
        f"# /// script\n# [tool.orchestrator.mock.scripts]\n# {scripts}\n# ///\n"
        "from smolagents import CodeAgent, InferenceClientModel\n"
        "researcher = CodeAgent(tools=[], model=InferenceClientModel(), name='researcher',\n"
        "                       description='looks things up')\n"
        "manager = CodeAgent(tools=[], model=InferenceClientModel(), managed_agents=[researcher])\n"
        "print('built')\nmanager.run('Who wrote Dune?')\nprint('never printed in a check')\n"
    )
    return program


def misspelled_team(tmp_path: Path, name: str = '"librarian"') -> Path:
    """research_team with its librarian's mock script keyed `librarain`, the librarian made
    with `name=` this expression (a literal, or a name the source binds later)."""
    folder = tmp_path / "team"
    shutil.copytree(REPO / "agent_payloads" / "research_team", folder)
    manifest, team = folder / "manifest.toml", folder / "team.py"
    text, code = manifest.read_text(), team.read_text()
    assert "\nlibrarian = [" in text and 'name="librarian"' in code
    manifest.write_text(text.replace("\nlibrarian = [", "\nlibrarain = ["))
    team.write_text(code.replace('name="librarian"', f"name={name}") + 'LIBRARIAN = "librarian"\n')
    return folder


#: The runtime's words for the misspelled script (`protocol.unknown_script_problem`), with the
#: names the host reads from team.py (in the order they are made).
LIBRARAIN = (
    "mock script for 'librarain', which is not an agent of the tree (agents: librarian, manager)"
)


@pytest.mark.docker
def test_run_refuses_a_mock_script_for_no_agent_before_any_sandbox(
    tmp_path: Path, nothing_starts: None
) -> None:
    """The agent names are read from the source (literal `name=`), so `run`,
    `batch` and a program's `run` refuse a script keyed for no agent with exit 2 before any
    sandbox (no container, no record), in the runtime's words, naming the file and line, the
    field, the agents found and the closest (before: the run started in a sandbox)."""
    from orchestrator.records.store import Store

    before = {r["run_id"] for r in Store().list_runs(limit=0, kind=None)}
    folder = misspelled_team(tmp_path)
    manifest = folder / "manifest.toml"
    line = manifest.read_text().splitlines().index("librarain = [") + 1
    where = f"orchestrator: error: {manifest}:{line}: field `mock.scripts.librarain`: "
    ran = cli("run", str(folder))
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.startswith(where + LIBRARAIN), ran.stderr
    assert "did you mean `librarian`?" in ran.stderr and "Traceback" not in ran.stderr
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task": "t1"}\n{"task": "t2"}\n')
    batch = cli("batch", str(folder), str(tasks), "-o", str(tmp_path / "out"), "-q")
    assert batch.returncode == 2 and batch.stderr.startswith(where + LIBRARAIN), batch.stderr
    program = typo_program(tmp_path)
    typo = cli("run", "--model", "mock", str(program))
    assert typo.returncode == 2, typo.stderr
    assert typo.stderr.startswith(
        f"orchestrator: error: {program}:3: field `tool.orchestrator.mock.scripts.reseacher`: "
        "mock script for 'reseacher', which is not an agent of the tree (agents: researcher, "
        "manager), as read from typo.py; did you mean `researcher`?"
    ), typo.stderr
    assert [r for r in Store().list_runs(limit=0, kind=None) if r["run_id"] not in before] == []


@pytest.mark.docker
def test_validate_says_what_run_refuses_and_the_sandbox_checks_names_the_source_hides(
    tmp_path: Path, agent_image: str
) -> None:
    """`validate` gives the same refusal as `run` (the same function), and still loads the
    tree for the other problems, each said once. A name the source does not spell out
    (`name=LIBRARIAN`) leaves the check to the sandbox's load: exit 2 still, in its words."""
    folder = misspelled_team(tmp_path)
    cause, fix = cli("run", str(folder)).stderr.splitlines()[:2]
    refusal = cause.removeprefix("orchestrator: error: ") + " " + fix.strip().removeprefix("fix: ")
    assert LIBRARAIN in refusal
    checked = cli("validate", str(folder))
    assert checked.returncode == 2, checked.stderr
    assert f"orchestrator: problem: {refusal}" in checked.stderr.splitlines()
    assert checked.stderr.count("mock script for 'librarain'") == 1
    assert "no mock script for agent 'librarian'" in checked.stderr  # found by the load
    hidden = misspelled_team(tmp_path / "hidden", name="LIBRARIAN")
    in_sandbox = "mock script for 'librarain', which is not an agent of the tree (agents: manager, "
    ran = cli("run", str(hidden))
    assert ran.returncode == 2 and in_sandbox in ran.stderr, ran.stderr
    assert "payload_error" in ran.stderr and "record:" in ran.stderr  # it ran in a sandbox
    checked = cli("validate", str(hidden))
    assert checked.returncode == 2 and in_sandbox in checked.stderr, checked.stderr
    assert "field `mock.scripts" not in ran.stderr + checked.stderr


def test_agent_names_are_read_from_the_source_only_where_it_tells_them(tmp_path: Path) -> None:
    """Literal `name=` of smolagents' agent classes and of the payload's subclasses; `manager`
    for one made without a name; None (the sandbox decides) wherever the source cannot tell."""
    from orchestrator.payloads.agentnames import agent_names

    def names(source: str, requirements: tuple[str, ...] = ()) -> list[str] | None:
        head = "from smolagents import CodeAgent, ToolCallingAgent\n"
        return agent_names({"agent.py": head + source, "data.txt": "x"}, requirements)

    made = "a = ToolCallingAgent(tools=[], model=m, name='web', description='d')\n"
    assert names(made + "CodeAgent(tools=[], model=m, managed_agents=[a])") == ["web", "manager"]
    assert names("CodeAgent(tools=[], model=m, name=None)") == ["manager"]
    assert names("class Mine(CodeAgent):\n    x = 1\n\nMine(tools=[], model=m, name='mine')") == [
        "mine"
    ]
    annotated = "def build(m) -> CodeAgent:\n    return CodeAgent(tools=[], model=m, name='c')\n"
    assert names(annotated) == ["c"]
    assert names("import requests\nCodeAgent(tools=[], model=m, name='c')") == ["c"]
    hidden = [
        "CodeAgent(tools=[], model=m, name=NAME)",
        "CodeAgent(tools=[], model=m, **options)",
        "class Mine(CodeAgent):\n    def __init__(self, **kw):\n        super().__init__(**kw)",
        "make = CodeAgent\nmake(tools=[], model=m, name='x')",
        "a = CodeAgent(tools=[], model=m, name='x')\na.name = other",
        "a = CodeAgent.from_hub('someone/agent')",
        "exec(open('more.txt').read())",
    ]
    for source in hidden:
        assert names(source) is None, source
    # A requirement's code may make agents: with requirements, an import of none of the
    # standard library, smolagents or the payload's own modules hides the names.
    assert names("import vendor\nCodeAgent(tools=[], model=m, name='c')", ("vendor",)) is None
    assert names("import json\nCodeAgent(tools=[], model=m, name='c')", ("vendor",)) == ["c"]
    assert names("x = 1\n") is None and names("def f(:\n") is None  # no agent, a bad file
    # A program may make agents later: only a misspelling of a known name is refused, and
    # its later unnamed top levels are manager_2, manager_3...
    fine = typo_program(tmp_path, "manager_2 = ['x']\n# summarizer = ['x']")
    prepare(RunSpec(payload=fine, model="mock"))
    with pytest.raises(ManifestError, match="reseacher.*did you mean `researcher`"):
        prepare(RunSpec(payload=typo_program(tmp_path), model="mock"))


@pytest.mark.docker
def test_a_program_gets_the_options_after_its_path() -> None:
    """`run [OPTIONS] PROGRAM --question X`: the program's argparse reads them; an option
    orchestrator also has goes to the program too (and `run` says so), unless after `--`."""
    ask = PROGRAMS / "ask.py"
    ran = cli("run", "--json", str(ask), "--question", "Who wrote Dune?", "--model", "its")
    assert ran.returncode == 0, ran.stderr
    outcome = json.loads(ran.stdout)
    assert outcome["output"].strip() == "question='Who wrote Dune?' model='its'", outcome
    assert outcome["model"].startswith("mock")  # not orchestrator's --model
    assert "--model came after the program's path, so the program gets it" in ran.stderr
    start = next(e for e in events_in(outcome["record_dir"]) if e["type"] == "run_start")
    assert start["program"]["argv"] == ["--question", "Who wrote Dune?", "--model", "its"]
    separated = cli("run", "--json", str(ask), "--", "--question", "Q", "--model", "m")
    assert separated.returncode == 0, separated.stderr
    assert json.loads(separated.stdout)["output"].strip() == "question='Q' model='m'"
    assert "came after the program's path" not in separated.stderr


@pytest.mark.docker
def test_new_program_writes_one_that_runs_as_generated(tmp_path: Path) -> None:
    made = cli("new", "--program", "facts", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    program = tmp_path / "facts.py"
    assert program.read_text().startswith("# /// script\n")
    result = cli("run", "--json", str(program))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["answer"] == "100" and outcome["model"].startswith("mock")
    # --model program: its own InferenceClientModel, whose key must then be set.
    own = cli("run", "--model", "program", str(program), env={"HF_TOKEN": ""})
    assert own.returncode == 2 and "HF_TOKEN" in own.stderr


@pytest.mark.docker
def test_a_schedule_fires_a_program_with_its_task(tmp_path: Path) -> None:
    """A schedule names a program like a payload; its task replaces the first agent run's,
    and the program's own models are the default (here replaced by `model = "mock"`)."""
    name = f"prog-{secrets.token_hex(4)}"
    (tmp_path / "schedules.toml").write_text(
        f'[[schedule]]\nname = "{name}"\ncron = "@daily"\n'
        f'payload = "{PROGRAMS / "two_runs.py"}"\ntask = "Add 40 and 2."\nmodel = "mock"\n'
        "limits = { timeout_seconds = 120 }\n"
    )
    path = tmp_path / "schedules.toml"
    assert cli("schedule", "validate", "--file", str(path)).returncode == 0
    # two_runs.py's agents have no scripts: the mock model plays none, so the first fails.
    out = cli("schedule", "run", name, "--file", str(path))
    assert f"schedule={name}" in out.stdout and "run=r-" in out.stdout
    run_id = re.search(r"run=(\S+)", out.stdout).group(1)  # type: ignore[union-attr]
    shown = json.loads(cli("runs", "show", run_id, "--json").stdout)
    events = [
        json.loads(e) for e in (Path(shown["record_dir"]) / "events.jsonl").read_text().splitlines()
    ]
    (first, *_) = [e for e in events if e["type"] == "agent_run"]
    assert first["task"] == "Add 40 and 2." and first["program_task"] == "Add 1 and 2."


def test_a_programs_spans_are_under_the_hosts_root() -> None:
    trace = {"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "parent_span_id": "00f067aa0ba902b7"}
    scripts = {"first": [code("final_answer(3)")], "manager": [code("final_answer(42)")]}
    request = program_request(PROGRAMS / "two_runs.py", scripts)
    request["trace"] = trace
    out = run_runtime(request, args=("--preload", "traces"))
    assert out.end["state"] == "success", out.stderr
    spans = out.of_type("span")
    by_id = {s["span_id"] for s in spans}
    tops = [s for s in spans if s["parent_span_id"] not in by_id]
    assert [(s["name"], s["parent_span_id"]) for s in tops] == [
        ("first.run", trace["parent_span_id"]),
        ("manager.run", trace["parent_span_id"]),  # named before it ran
    ]


# ---- helpers the backend tests share (backends/e2b/test_backend_program.py, -------------
# ---- examples/test_program_ray.py) ---------------------------------------------------------


def events_in(record_dir: str) -> list[dict[str, Any]]:
    lines = (Path(record_dir) / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def agent_trace(events: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """The steps and managed-agent calls of a run, by agent."""
    kinds = ("step", "managed_agent_call", "managed_agent_result")
    return [(e["type"], e.get("agent")) for e in events if e["type"] in kinds]


#: What the guide's program does with `fib_team_answer`: the manager calls coder_agent,
#: which computes the number in one step; the manager then answers with its report.
FIB_TEAM_TRACE = [
    ("managed_agent_call", "coder_agent"),
    ("step", "coder_agent"),
    ("managed_agent_result", "coder_agent"),
    ("step", "manager"),
    ("step", "manager"),
]
