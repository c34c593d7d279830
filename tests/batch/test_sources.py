"""Batch tasks from datasets as evaluators have them (orchestrator/batch/sources.py): Parquet,
JSON arrays, Hugging Face dataset folders and cache, a field mapping, and the selection; then
whole batches from a Parquet file, through the command and through `orchestrator.evaluate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.batch import TaskFileError, read_tasks
from orchestrator.batch.plan import default_output
from orchestrator.errors import ConfigError
from tests.conftest import TEST_PAYLOADS, cli

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

MATH = TEST_PAYLOADS / "batch_math"
QA = {"task": "question", "expected": "answer", "id": "task_id"}


def qa_rows(n: int) -> list[dict]:
    """Rows as a dataset on the hub has them: its own column names, and more columns."""
    return [
        {
            "task_id": f"s{i}",
            "question": f"What is {i} + 2?",
            "answer": i + 2,
            "level": i % 3,
            "op": "add",
            "a": i,
            "b": 2,
        }
        for i in range(n)
    ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_with_a_field_mapping(tmp_path: Path) -> None:
    file = read_tasks(write_parquet(tmp_path / "qa.parquet", qa_rows(3)), fields=QA)
    first = file.tasks[0]
    assert [t.id for t in file.tasks] == ["s0", "s1", "s2"] and file.fields == QA
    assert (first.task, first.expected, first.line) == ("What is 0 + 2?", 2, 0)
    # Columns that are not mapped are kept for scorers, under metadata.
    assert first.metadata == {"level": 0, "op": "add", "a": 0, "b": 2}
    args = read_tasks(tmp_path / "qa.parquet", fields={**QA, "args.a": "a", "args.op": "op"})
    assert args.tasks[1].additional_args == {"a": 1, "op": "add"}
    assert args.tasks[1].metadata == {"level": 1, "b": 2}


def test_a_local_hugging_face_dataset_folder(tmp_path: Path) -> None:
    """Saved with save_to_disk (a Dataset, a DatasetDict and its splits), or data files."""
    rows = qa_rows(4)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert [t.id for t in read_tasks(tmp_path / "saved", fields=QA).tasks] == [
        "s0",
        "s1",
        "s2",
        "s3",
    ]
    both = datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(rows[:2]), "train": datasets.Dataset.from_list(rows)}
    )
    both.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(TaskFileError) as info:
        read_tasks(tmp_path / "dict", fields=QA)
    assert "has the splits test, train; which one?" in info.value.cause
    assert f"{tmp_path / 'dict'}@test" in info.value.fix
    assert len(read_tasks(f"{tmp_path / 'dict'}@test", fields=QA).tasks) == 2
    files = tmp_path / "files" / "data"
    files.mkdir(parents=True)
    write_parquet(files / "test-00000-of-00001.parquet", rows[:3])
    assert len(read_tasks(tmp_path / "files", fields=QA).tasks) == 3


def test_a_bad_row_of_a_table_is_named_by_its_index(tmp_path: Path) -> None:
    rows = qa_rows(3)
    rows[1]["question"] = None
    path = write_parquet(tmp_path / "qa.parquet", rows)
    with pytest.raises(TaskFileError) as info:
        read_tasks(path, fields=QA)
    assert f"{path}:1: `task`" in info.value.cause and info.value.exit_code == 2
    assert [t.id for t in read_tasks(path, fields=QA, on_bad_line="skip").tasks] == ["s0", "s2"]


def test_json_array_rows_are_named_by_their_line(tmp_path: Path) -> None:
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([*qa_rows(2), {"task_id": "x", "question": ""}], indent=1))
    with pytest.raises(TaskFileError) as info:
        read_tasks(path, fields=QA)
    lines = path.read_text().splitlines()
    start = len(lines) - lines[::-1].index(" {")  # the line the third object starts on
    assert start == 20 and f"{path}:{start}: `task` '' is empty" in info.value.cause


def test_csv_and_jsonl_with_their_own_column_names(tmp_path: Path) -> None:
    """A mapping lifts the check that every column is a task field (the data was written for
    another tool); a JSONL row without the mapped column lacks its field."""
    csv = tmp_path / "qa.csv"
    csv.write_text("task_id,question,answer,source\nq1,What is 2 + 2?,4,book\n")
    (task,) = read_tasks(csv, fields=QA).tasks
    assert (task.id, task.task, task.expected, task.metadata) == (
        "q1",
        "What is 2 + 2?",
        "4",
        {"source": "book"},
    )
    jsonl = tmp_path / "qa.jsonl"
    jsonl.write_text('{"question": "a", "answer": 1}\n{"answer": 2}\n')
    with pytest.raises(TaskFileError) as info:
        read_tasks(jsonl, fields={"task": "question", "expected": "answer"})
    assert f"{jsonl}:2: `task`" in info.value.cause


def test_a_fields_file_beside_the_data_and_flags_over_it(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "qa.parquet", qa_rows(2))
    (tmp_path / "qa.parquet.fields.toml").write_text(
        'task = "question"\nexpected = "answer"\nid = "task_id"\n'
    )
    assert read_tasks(path).tasks[0].expected == 2
    assert read_tasks(path, fields={"expected": "level"}).tasks[1].expected == 1


def test_a_mapping_naming_a_missing_column_names_the_columns(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "qa.parquet", qa_rows(2))
    with pytest.raises(TaskFileError) as info:
        read_tasks(path, fields={"task": "questoin"})
    cause = info.value.cause
    assert "no column 'questoin' (for `task`)" in cause
    assert "its columns are: task_id, question, answer, level, op, a, b" in cause
    with pytest.raises(ConfigError, match="No task field 'prompt'"):
        read_tasks(path, fields={"prompt": "question"})


def test_limit_sample_id_and_shuffle(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "qa.parquet", qa_rows(10))
    assert [t.id for t in read_tasks(path, fields=QA, limit=3).tasks] == ["s0", "s1", "s2"]
    picked = read_tasks(path, fields=QA, sample_ids=["s7", "s2", "s7"]).tasks
    assert [t.id for t in picked] == ["s2", "s7"]  # in the file's order, each once
    with pytest.raises(TaskFileError) as info:
        read_tasks(path, fields=QA, sample_ids=["s2", "nope"])
    assert "no task with the id(s):\n  nope" in info.value.cause
    one = [t.id for t in read_tasks(path, fields=QA, shuffle=7).tasks]
    assert sorted(one) == sorted(f"s{i}" for i in range(10)) and one != sorted(one)
    assert one == [t.id for t in read_tasks(path, fields=QA, shuffle=7).tasks]
    assert one != [t.id for t in read_tasks(path, fields=QA, shuffle=8).tasks]
    # The order depends on the seed and the ids, not on the file's order: the same sample.
    write_parquet(tmp_path / "reversed.parquet", qa_rows(10)[::-1])
    sample = read_tasks(tmp_path / "reversed.parquet", fields=QA, shuffle=7, limit=4).tasks
    assert [t.id for t in sample] == one[:4]
    with pytest.raises(ConfigError, match="--limit must be at least 1"):
        read_tasks(path, fields=QA, limit=0)


def test_a_hub_dataset_comes_from_the_cache_when_the_hub_cannot_be_reached(
    tmp_path: Path,
) -> None:
    """A cache laid out as the library lays out a hub dataset it loaded (here from a Parquet
    file, as the hub serves them), in a HF_HOME of its own; the hub is out of reach here
    (or offline mode is on). A dataset the cache lacks is an error naming both."""
    write_parquet(tmp_path / "qa.parquet", qa_rows(3))
    script = f"""
import json, shutil, sys
from pathlib import Path
import datasets
datasets.load_dataset("parquet", data_files={{"test": {str(tmp_path / "qa.parquet")!r}}})
root = Path(datasets.config.HF_DATASETS_CACHE)
built = next(p for p in (root / "parquet").glob("*/0.0.0/*") if p.is_dir())
cached = root / "tests___tiny_qa" / "default" / "0.0.0" / built.name
shutil.copytree(built, cached)
(cached / "parquet-test.arrow").rename(cached / "tiny_qa-test.arrow")
from orchestrator.batch import TaskFileError, read_tasks
from orchestrator.batch.plan import default_output
fields = {QA!r}
print(json.dumps([t.id for t in read_tasks("hf://tests/tiny_qa@test", fields=fields).tasks]))
try:
    read_tasks("hf://tests/not_cached@test", fields=fields)
except TaskFileError as exc:
    print(json.dumps([exc.cause, exc.fix]))
"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_DATASETS_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    ids, error = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert ids == ["s0", "s1", "s2"]
    cause, fix = error
    assert "Cannot read hf://tests/not_cached@test: the Hugging Face hub" in cause
    assert "could not be reached" in cause and f"local cache ({tmp_path / 'hf'}" in cause
    assert "save_to_disk(FOLDER)" in fix


def test_a_bad_mapping_exits_2_naming_the_missing_column(tmp_path: Path) -> None:
    """Through the command, before anything starts (no engine needed)."""
    path = write_parquet(tmp_path / "qa.parquet", qa_rows(2))
    out = tmp_path / "out"
    done = cli("batch", str(MATH), str(path), "-o", str(out), "--field", "task=prompt", "-q")
    assert done.returncode == 2, done.stderr
    assert "no column 'prompt' (for `task`); its columns are: task_id, question" in done.stderr
    assert "Traceback" not in done.stderr and not out.exists()
    bad = cli("batch", str(MATH), str(path), "--field", "task", "-q")
    assert bad.returncode == 2 and "--field 'task' is not FIELD=COLUMN" in bad.stderr


def test_the_default_output_folder_is_named_after_the_dataset() -> None:
    assert default_output("x/math", "hf://openai/gsm8k:main@test") == Path(
        "batches/math-gsm8k-main-test"
    )
    assert default_output("math", "data/gsm8k@test") == Path("batches/math-gsm8k-test")
    assert default_output("math", "data/qa.parquet") == Path("batches/math-qa")


def test_a_missing_extra_is_named(tmp_path: Path) -> None:
    """Without pyarrow (hidden from the import system), the error names the extra."""
    path = write_parquet(tmp_path / "qa.parquet", qa_rows(1))
    script = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "from orchestrator.batch import TaskFileError, read_tasks\n"
        f"try: read_tasks({str(path)!r})\n"
        "except TaskFileError as e: print(e.cause, e.fix)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "needs the `pyarrow` package" in done.stdout, done.stderr
    assert "pip install 'orchestrator[datasets]'" in done.stdout


# --- whole batches from a Parquet file (Docker) ---------------------------------------------

MATH_FIELDS = ["task=question", "expected=answer", "id=task_id", "args.op=op"]
MATH_FIELDS += ["args.a=a", "args.b=b"]


@pytest.mark.docker
def test_a_parquet_batch_with_field_mapping_limit_and_shuffle(
    tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    path = write_parquet(tmp_path / "qa.parquet", qa_rows(5))
    out = tmp_path / "out"
    flags = [arg for pair in MATH_FIELDS for arg in ("--field", pair)]
    flags += "--shuffle 3 --limit 3 --json -q".split()
    done = cli("batch", str(MATH), str(path), "-o", str(out), *flags)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    chosen = [t.id for t in read_tasks(path, fields=QA, shuffle=3, limit=3).tasks]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in results) == sorted(chosen)
    assert all(r["status"] == "succeeded" and r["score"] == 1.0 for r in results), results
    assert summary["total"] == 3 and summary["accuracy"] == 1.0
    meta = json.loads((out / "batch.json").read_text())
    assert meta["tasks_file"] == str(path.resolve())
    assert meta["options"]["fields"]["args.op"] == "op"


@pytest.mark.docker
def test_evaluate_runs_a_batch_from_python(tmp_path: Path, agent_image: str, no_leftovers):
    """`orchestrator.evaluate`, as a notebook calls it: a saved Hugging Face dataset with
    its own column names, the mock model; it returns the summary the command prints."""
    import orchestrator

    rows = qa_rows(3)
    rows[2]["answer"] = 99  # a wrong expected answer: scored 0
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "qa"))
    fields = dict(pair.split("=") for pair in MATH_FIELDS)
    seen: list[dict] = []
    summary = orchestrator.evaluate(
        MATH,
        tmp_path / "qa",
        output=tmp_path / "out",
        fields=fields,
        model="mock",
        concurrency=2,
        on_result=seen.append,
    )
    assert isinstance(summary, orchestrator.BatchSummary)
    assert summary.state == "complete" and summary.exit_code == 0 and summary.total == 3
    assert summary.counts["succeeded"] == 3 and summary.correct == 2 and len(seen) == 3
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["accuracy"] == (
        summary.accuracy
    )
    with pytest.raises(TypeError, match="unknown option"):
        orchestrator.evaluate(MATH, tmp_path / "qa", fields=fields, concurency=2)
