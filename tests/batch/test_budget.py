"""A batch-wide spend cap: `batch --max-total-tokens N` counts the tokens the
model gateway measured; at the cap no task starts, running ones are stopped (`budget_exceeded`,
run again on resume) and the batch exits 5; the same command with a higher cap resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.batch import BatchProgress, BatchSpec, plan_batch
from orchestrator.cli.batch_display import progress_line
from orchestrator.errors import ConfigError
from orchestrator.payloads.manifest import load_manifest
from orchestrator.spec import RunSpec
from tests.batch.test_session import MATH, math_rows, write_jsonl
from tests.conftest import cli
from tests.model_server import ScriptedModelServer
from tests.test_gateway import model_key  # noqa: F401 - a fixture

docker = pytest.mark.docker


def attempts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "attempts.jsonl").open()]


@pytest.mark.parametrize("cap", ["0", "-3", "many", "1.5"])
def test_a_cap_that_is_no_positive_whole_number_is_refused_before_anything_starts(
    tmp_path: Path, cap: str
) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(2))
    out = tmp_path / "out"
    refused = cli("batch", str(MATH), str(tasks), "-o", str(out), "--max-total-tokens", cap)
    assert refused.returncode == 2, refused.stderr
    assert "--max-total-tokens" in refused.stderr and not out.exists(), refused.stderr


def test_the_python_api_checks_the_cap_too(tmp_path: Path) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(1))
    spec = BatchSpec(tasks=tasks, output=None, run=RunSpec(payload=MATH), max_total_tokens=0)
    with pytest.raises(ConfigError, match="--max-total-tokens must be a positive whole number"):
        plan_batch(spec)


def test_the_progress_line_shows_the_spend_against_the_cap() -> None:
    progress = BatchProgress(
        total=3,
        done=1,
        running=1,
        counts={"succeeded": 1},
        ran=1,
        retries=0,
        elapsed=5.0,
        stopping=None,
        spent_tokens=1234,
        max_total_tokens=5000,
    )
    assert "1234/5000 tokens" in progress_line(progress)
    uncapped = BatchProgress(**{**progress.__dict__, "max_total_tokens": None})
    assert "tokens" not in progress_line(uncapped) and "$" not in progress_line(uncapped)
    costed = BatchProgress(**{**progress.__dict__, "spent_cost": 0.0123, "max_cost": 5.0})
    assert "$0.0123/$5.00" in progress_line(costed)


@docker
@pytest.mark.usefixtures("model_key", "nothing_left")
def test_a_batch_stops_at_its_token_cap_and_a_higher_cap_resumes_it(
    agent_image: str, tmp_path: Path
) -> None:
    """Acceptance 4, through the command: concurrency 1, the gateway measuring every call."""
    step = load_manifest(MATH).mock_scripts["manager"][0]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(3))
    out = tmp_path / "out"

    with ScriptedModelServer([step] * 10) as server:  # the load checks ask no model

        def batch(cap: int) -> tuple[int, dict, str]:
            proc = cli(
                "batch",
                str(MATH),
                str(tasks),
                "-o",
                str(out),
                "-j",
                "1",
                "--no-warm",
                "--model",
                "openai:scripted",
                "--api-base",
                server.api_base(),
                "--max-total-tokens",
                str(cap),
                "--json",
            )
            return proc.returncode, json.loads(proc.stdout), proc.stderr

        # 1 token: the first task's first model call reaches the cap.
        code, summary, stderr = batch(1)
        spent = summary["spend"]["tokens"]
        assert code == 5, stderr
        assert summary["state"] == "stopped" and summary["stop_reason"] == "budget_exceeded"
        assert "--max-total-tokens 1 was reached" in stderr and "higher" in stderr, stderr
        started = [a for a in attempts(out) if a["event"] == "start"]
        assert len(started) == 1  # no task started after the cap was reached
        assert spent == sum(server.usage.values()) > 1  # what the gateway measured
        assert summary["spend"]["source"] == "gateway" and summary["spend"]["cap_reached"]
        assert summary["spend"]["stopped_by"] == "max_total_tokens"
        (first,) = [a for a in attempts(out) if a["event"] == "end"]
        # The crossing call's run is stopped, unless it ended before the host saw the call.
        assert first["status"] in ("budget_exceeded", "succeeded"), first
        if first["status"] == "budget_exceeded":
            assert first["error"]["type"] == "budget_exceeded"
            assert "--max-total-tokens 1 was reached" in first["error"]["message"]
            # The run's own record says the batch's cap stopped it, not "cancelled by the user".
            record = json.loads((Path(first["record_dir"]) / "result.json").read_text())
            assert record["status"] == "cancelled" and record["error"] == first["error"], record
            assert summary["spend"]["attempts_stopped"] == 1 and summary["pending"] == 3
        else:
            assert summary["pending"] == 2

        # The same cap again: already spent, nothing starts (no sandbox, not even the check).
        code, summary, stderr = batch(1)
        assert code == 5 and summary["stop_reason"] == "budget_exceeded", stderr
        assert len(attempts(out)) == 2 and summary["spend"]["tokens"] == spent

        # A higher cap that the next task's call reaches: earlier sessions' spend counts.
        code, summary, stderr = batch(spent + 1)
        assert code == 5 and summary["stop_reason"] == "budget_exceeded", stderr
        assert len([a for a in attempts(out) if a["event"] == "start"]) == 2
        assert summary["spend"]["tokens"] == sum(server.usage.values())

        # High enough: the rest runs, tasks stopped by the cap included.
        code, summary, stderr = batch(10**9)
        served = sum(server.usage.values())
    assert code == 0, stderr
    assert summary["state"] == "complete" and summary["counts"]["succeeded"] == 3, summary
    assert summary["spend"] == {
        "max_total_tokens": 10**9,
        "tokens": served,
        "source": "gateway",
        "max_cost_usd": None,
        "cost_usd": None,
        "price": None,
        "uncounted_calls": 0,
        "cap_reached": False,
        "stopped_by": None,
        "attempts_stopped": summary["spend"]["attempts_stopped"],
    }
    rows = [json.loads(line) for line in (out / "results.jsonl").open()]
    assert sorted(row["id"] for row in rows) == sorted(r["id"] for r in math_rows(3))
    assert summary["tokens_all_attempts"]["input"] + summary["tokens_all_attempts"]["output"] == (
        served
    )
