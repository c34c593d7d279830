"""smolagents' own examples run as their authors wrote them.

`tests/programs/text_to_sql.py` is smolagents' `examples/text_to_sql.py`, byte for byte (its
origin and licence: tests/programs/README.md). It needs `sqlalchemy`, which the agent image
does not have; `run` has no flag that adds a requirement, so `text_to_sql_pep723.py` is the
same text with a PEP 723 block above it that says so, and the run builds (once) the derived
image with it. The scripted model writes what a model would: a query through the program's
own `sql_engine` tool, and the answer taken from what the query returned.

The program's database is SQLite in memory, which SQLAlchemy keeps per thread: the tool finds
the table only because our executor runs the agent's code in the program's own thread
(`timeout_seconds=None`, orchestrator_runtime/agents.py). smolagents' default executor runs
each code block in a new thread (its `timeout_seconds=30`), where the query would find no
`receipts` table (smolagents PR #2475 proposes a StaticPool in the example for this); this
test fails if that comes back.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import REPO, cli, files_holding
from tests.model_server import ScriptedModelServer

PROGRAMS = REPO / "tests" / "programs"
TEXT_TO_SQL = PROGRAMS / "text_to_sql.py"
TEXT_TO_SQL_PEP723 = PROGRAMS / "text_to_sql_pep723.py"
#: The git blob id of examples/text_to_sql.py in smolagents at v1.26.0
#: (12c1bc820eca50ace6f80a21d90426d41d74f845), as `git ls-tree v1.26.0 examples/` names it.
UPSTREAM_BLOB = "1b5bd3d6dfe58af2ddb99093ad1fb6d97e4bfc04"
PEP723_BLOCK = (
    "# /// script\n"
    "# # smolagents' examples/text_to_sql.py (v1.26.0, Apache-2.0), unmodified below this\n"
    "# # block, which was added to declare its requirement: see NOTICE beside this file.\n"
    '# dependencies = ["sqlalchemy"]\n'
    "# ///\n"
)
#: The model the program chose (`InferenceClientModel(model_id=...)`, no provider).
MODEL_ID = "meta-llama/Meta-Llama-3.1-8B-Instruct"

#: One CodeAgent step: the most expensive receipt's customer, queried with the program's
#: tool, and the answer cut from the row it returned (`sql_engine` gives "\n('Name',)").
#: The name itself is nowhere in the script: only the program's database holds it.
QUERY_STEP = (
    "Thought: I will ask the receipts table for the customer of the most expensive receipt.\n"
    "<code>\n"
    'rows = sql_engine(query="SELECT customer_name FROM receipts ORDER BY price DESC LIMIT 1")\n'
    "print(rows)\n"
    'final_answer(rows.strip().strip("(),\'"))\n'
    "</code>"
)


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's bytes (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's id


def test_the_example_is_smolagents_file_byte_for_byte() -> None:
    original = TEXT_TO_SQL.read_bytes()
    assert git_blob_id(original) == UPSTREAM_BLOB
    # The copy is the same bytes under its PEP 723 block, nothing else.
    assert TEXT_TO_SQL_PEP723.read_bytes() == PEP723_BLOCK.encode() + original


def run_text_to_sql(token: str) -> tuple[subprocess.CompletedProcess[str], ScriptedModelServer]:
    with ScriptedModelServer([QUERY_STEP]) as server:
        result = cli(
            "run",
            "--api-base",
            server.api_base(),
            "--json",
            str(TEXT_TO_SQL_PEP723),
            env={"HF_TOKEN": token},
            timeout=900,  # the first run may build the image
        )
    return result, server


def sqlalchemy_images(docker_client: Any, agent_image: str) -> dict[str, int]:
    """The derived images adding sqlalchemy to this agent image: id -> creation time (only
    these: other test sessions on the engine may build images of their own meanwhile)."""
    labels = [
        "orchestrator.kind=payload-image",
        "orchestrator.requirements=sqlalchemy",
        f"orchestrator.agent-image={agent_image}",
    ]
    images = docker_client.api.images(filters={"label": labels})
    return {image["Id"]: image["Created"] for image in images}


def test_text_to_sql_answers_woodrow_wilson_from_its_database(
    agent_image: str, docker_client: Any, nothing_left: None
) -> None:
    token = f"hf_{secrets.token_hex(16)}"
    result, server = run_text_to_sql(token)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["status"] == "succeeded", outcome
    assert outcome["answer"] == "Woodrow Wilson"

    # The program's one model call reached the server through the gateway, with the host's
    # key, as the model the program chose.
    assert len(server.requests) == 1
    assert {r["headers"].get("Authorization") for r in server.requests} == {f"Bearer {token}"}
    assert {r["body"]["model"] for r in server.requests} == {MODEL_ID}
    record = Path(outcome["record_dir"])
    assert not files_holding(token, record)

    # The answer came from the query: the tool ran in the sandbox, on the program's database.
    events = [json.loads(line) for line in (record / "events.jsonl").read_text().splitlines()]
    (step,) = [e for e in events if e["type"] == "step"]
    assert step["agent"] == "manager"
    assert "sql_engine(" in json.dumps(step)
    assert "('Woodrow Wilson',)" in json.dumps(step)  # the row, in the step's observations
    start = next(e for e in events if e["type"] == "run_start")
    (manager,) = start["agents"]
    assert manager["tools"] == ["final_answer", "sql_engine"]
    assert manager["model"]["class"] == "InferenceClientModel"
    assert manager["model"]["model_id"] == MODEL_ID
    logs = (record / "stderr.log").read_text()
    assert "  - customer_name: VARCHAR(16)" in logs  # the program's own print

    # The image is the one derived for sqlalchemy, and a second run uses it as it is.
    image = outcome["image"]
    labels = docker_client.api.inspect_image(image)["Config"]["Labels"]
    assert labels["orchestrator.kind"] == "payload-image"
    assert labels["orchestrator.requirements"] == "sqlalchemy"
    assert labels["orchestrator.agent-image"] == agent_image
    before = sqlalchemy_images(docker_client, agent_image)
    assert len(before) == 1
    again, server = run_text_to_sql(token)
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    assert (second["answer"], second["image"]) == ("Woodrow Wilson", image)
    assert sqlalchemy_images(docker_client, agent_image) == before  # nothing (re)built
    assert {r["headers"].get("Authorization") for r in server.requests} == {f"Bearer {token}"}
