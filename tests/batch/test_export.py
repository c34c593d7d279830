"""`batch export`: a batch folder as an Inspect AI eval log (read back with Inspect's own
reader, as `inspect view` reads it) and as a Parquet table (read back with pyarrow). Fast
tests on a folder written by the batch's own writers (plan, result lines, summary, rescore);
one docker test on a real batch with the mock model."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import httpx
import pytest

from orchestrator.batch.export import export_batch
from orchestrator.batch.grading import Scoring
from orchestrator.batch.ledger import SessionFacts, open_meta, result_row, summarize
from orchestrator.batch.output import BatchDir
from orchestrator.batch.plan import BatchSpec, plan_batch
from orchestrator.batch.rescore import rescore
from orchestrator.errors import ConfigError
from orchestrator.spec import RunError, RunResult, RunSpec
from tests.conftest import TEST_PAYLOADS, cli, wait_for

pa = pytest.importorskip("pyarrow")
parquet = pytest.importorskip("pyarrow.parquet")
inspect_log = pytest.importorskip("inspect_ai.log")

MATH = TEST_PAYLOADS / "batch_math"

TASKS = [
    {"id": "mul", "task": "6*7?", "additional_args": {"op": "mul", "a": 6, "b": 7}, "expected": 42},
    {
        "id": "wrong",
        "task": "1+2?",
        "additional_args": {"op": "add", "a": 1, "b": 2},
        "expected": 4,
    },
    {"id": "infra", "task": "2+2?", "expected": ["4", "four"]},
    {"id": "open", "task": "Say hi."},
]

#: What each task's attempt ended as: status, answer, tokens in/out.
OUTCOMES = {
    "mul": ("succeeded", 42, 120, 30),
    "wrong": ("succeeded", "3", 100, 20),
    "infra": ("infra_error", None, 0, 0),
    "open": ("succeeded", "hi", 50, 5),
}


def write_batch(root: Path) -> Path:
    """A batch folder as a session writes it, without sandboxes: batch.json from the plan,
    one result line per task (scored with the batch's scorer), a second epoch of `mul`
    (the `epoch` field of a batch run with epochs), attempts.jsonl end lines, summary.json;
    then a `batch rescore` with `contains`."""
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    spec = BatchSpec(tasks=tasks, output=root / "out", run=RunSpec(payload=MATH))
    plan = plan_batch(spec)
    out = BatchDir(root / "out")
    out.path.mkdir()
    meta = open_meta(out, plan)
    scoring = Scoring(["exact"], tolerance=1e-6, judge=None, folder=out.path)
    rows, started = [], time.time()
    for task in plan.file.tasks:
        status, answer, inputs, outputs = OUTCOMES[task.id]
        result = RunResult(
            run_id=f"r-{task.id}",
            status=status,
            answer=answer,
            error=RunError("engine", "the engine went away") if status == "infra_error" else None,
            token_usage={"input_tokens": inputs, "output_tokens": outputs},
            steps=2,
            timings={"duration": 1.5},
        )
        score = scoring.score(task.row(), status, answer).score
        row = result_row(
            task, result, score=score, attempts=1, history=[], first_start=started, session=1
        )
        out.append_result(row)
        out.append_attempt(
            {"event": "end", "id": task.id, "run_id": result.run_id, "cost_usd": "0.0015"}
        )
        rows.append(row)
    again = {**rows[0], "epoch": 2, "run_id": "r-mul-2", "answer": "41", "score": 0.0}
    out.append_result(again)
    facts = SessionFacts(meta["batch_id"], 1, started, len(rows), None, None, {})
    out.write_summary(summarize(plan, spec, out, rows, facts).to_dict())
    rescore(out.path, "contains")
    return out.path


@pytest.fixture
def batch_dir(tmp_path: Path) -> Path:
    return write_batch(tmp_path)


def test_inspect_log_reads_back_with_samples_scores_and_epochs(batch_dir: Path) -> None:
    path = export_batch(batch_dir, "inspect")
    assert path.parent == batch_dir / "inspect" and path.suffix == ".eval"
    log = inspect_log.read_eval_log(str(path))
    meta = json.loads((batch_dir / "batch.json").read_text())
    assert log.eval.task == "batch_math" and log.eval.model == "mock/scripted"
    assert log.eval.run_id == meta["batch_id"] and log.eval.config.epochs == 2
    assert log.eval.dataset.location == meta["tasks_file"]
    assert log.eval.dataset.sample_ids == ["mul", "wrong", "infra", "open"]
    samples = {(s.id, s.epoch): s for s in log.samples}
    assert sorted(samples) == [("infra", 1), ("mul", 1), ("mul", 2), ("open", 1), ("wrong", 1)]
    mul = samples["mul", 1]
    assert (mul.input, mul.target, mul.output.completion) == ("6*7?", "42", "42")
    assert mul.scores["exact"].value == "C" and mul.scores["contains"].value == "C"
    assert samples["mul", 2].scores["exact"].value == "I"
    assert samples["wrong", 1].scores["exact"].value == "I"
    assert mul.metadata["run_id"] == "r-mul" and mul.metadata["status"] == "succeeded"
    usage = mul.model_usage["mock/scripted"]
    assert (usage.input_tokens, usage.output_tokens, usage.total_cost) == (120, 30, 0.0015)
    infra = samples["infra", 1]
    assert infra.target == ["4", "four"] and not infra.scores
    assert infra.error is not None and "the engine went away" in infra.error.message
    assert samples["open", 1].target == "" and not samples["open", 1].scores
    # The batch ended with an infrastructure error left: Inspect's `error` status.
    assert log.status == "error" and "infra_error" in log.error.message
    # Epochs reduced to a task's mean, then Inspect's accuracy: mul 0.5, wrong 0.
    exact = next(s for s in log.results.scores if s.name == "exact")
    assert exact.reducer == "mean" and exact.scored_samples == 2 and exact.unscored_samples == 2
    assert exact.metrics["accuracy"].value == pytest.approx(0.25)
    assert exact.metrics["stderr"].value > 0
    assert [r.scorer for r in log.reductions] == ["exact", "contains"]


def test_inspect_view_reads_the_header_and_a_json_log(batch_dir: Path, tmp_path: Path) -> None:
    """`inspect view` lists logs by their header; a .json log is Inspect's other format."""
    path = export_batch(batch_dir, "inspect")
    header = inspect_log.read_eval_log(str(path), header_only=True)
    assert header.samples is None and header.results.total_samples == 5
    listed = inspect_log.list_eval_logs(str(path.parent))
    assert [Path(unquote(urlsplit(info.name).path)) for info in listed] == [path]
    assert (listed[0].task, listed[0].task_id) == ("batch-math", header.eval.task_id)
    as_json = export_batch(batch_dir, "inspect", tmp_path / "log.json")
    assert json.loads(as_json.read_text())["eval"]["task"] == "batch_math"
    assert len(inspect_log.read_eval_log(str(as_json)).samples) == 5


def test_inspect_view_serves_the_log(batch_dir: Path) -> None:
    """`inspect view` itself (its server, as the browser app asks it) lists and serves it."""
    path = export_batch(batch_dir, "inspect")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    inspect = Path(sys.executable).with_name("inspect")
    command = [str(inspect), "view", "start", "--log-dir", str(path.parent), "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api"
    try:

        def listing() -> list[dict] | None:
            try:
                return httpx.get(f"{api}/logs", timeout=5).json()["files"]
            except httpx.TransportError:
                return None

        files = wait_for(listing, 60)
        assert [Path(unquote(urlsplit(f["name"]).path)) for f in files] == [path]
        got = httpx.get(f"{api}/logs/{quote(str(path), safe='')}", timeout=30)
        assert got.status_code == 200, got.text
        log = got.json()
        assert (log["eval"]["task"], len(log["samples"])) == ("batch_math", 5)
        metrics = log["results"]["scores"][0]["metrics"]
        assert metrics["accuracy"]["value"] == pytest.approx(0.25)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_parquet_has_one_typed_row_per_attempt(batch_dir: Path) -> None:
    path = export_batch(batch_dir, "parquet")
    assert path == batch_dir / "results.parquet"
    table = parquet.read_table(path)
    assert table.schema.field("epoch").type == pa.int64()
    assert table.schema.field("ended_at").type == pa.timestamp("ms", tz="UTC")
    rows = {(r["task_id"], r["epoch"]): r for r in table.to_pylist()}
    assert sorted(rows) == [("infra", 1), ("mul", 1), ("mul", 2), ("open", 1), ("wrong", 1)]
    mul = rows["mul", 1]
    assert (mul["answer"], mul["expected"], mul["score"], mul["score_contains"]) == (
        "42",
        "42",
        1.0,
        1.0,
    )
    assert (mul["input_tokens"], mul["output_tokens"], mul["cost_usd"]) == (120, 30, 0.0015)
    assert (mul["status"], mul["run_id"], mul["duration"], mul["scorer"]) == (
        "succeeded",
        "r-mul",
        1.5,
        "exact",
    )
    assert rows["mul", 2]["score"] == 0.0 and rows["mul", 2]["run_id"] == "r-mul-2"
    infra = rows["infra", 1]
    assert infra["score"] is None and infra["expected"] == '["4", "four"]'
    assert "the engine went away" in infra["error"]
    assert rows["open", 1]["expected"] is None and rows["open", 1]["error"] is None


def test_without_the_extra_the_error_names_it(
    batch_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # an import of it fails, as uninstalled
    with pytest.raises(ConfigError) as raised:
        export_batch(batch_dir, "parquet")
    assert "pyarrow" in str(raised.value) and "orchestrator[export]" in raised.value.fix
    assert raised.value.exit_code == 2


def test_cli_writes_where_asked_and_refuses_a_folder_that_is_no_batch(
    batch_dir: Path, tmp_path: Path
) -> None:
    target = tmp_path / "all.parquet"
    done = cli("batch", "export", str(batch_dir), "--format", "parquet", "-o", str(target))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"written: {target}"
    assert parquet.read_table(target).num_rows == 5
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = cli("batch", "export", str(empty), "--format", "inspect")
    assert refused.returncode == 2 and "not a batch output folder" in refused.stderr


@pytest.mark.docker
def test_a_real_batch_exports_both_ways(tmp_path: Path, agent_image: str) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS[:2]))
    out = tmp_path / "out"
    done = cli("batch", str(MATH), str(tasks), "-o", str(out), "--model", "mock", "-q")
    assert done.returncode == 0, done.stderr
    log = inspect_log.read_eval_log(str(export_batch(out, "inspect")))
    assert log.status == "success"
    assert {(s.id, s.epoch): s.scores["exact"].value for s in log.samples} == {
        ("mul", 1): "C",
        ("wrong", 1): "I",
    }
    assert log.results.scores[0].metrics["accuracy"].value == 0.5
    rows = parquet.read_table(export_batch(out, "parquet")).to_pylist()
    assert {(r["task_id"], r["status"], r["score"]) for r in rows} == {
        ("mul", "succeeded", 1.0),
        ("wrong", "succeeded", 0.0),
    }
    assert all(r["run_id"] and r["duration"] > 0 for r in rows)
