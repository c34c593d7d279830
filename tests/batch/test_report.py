"""`batch report` and `batch rescore` over a real batch (real sandboxes, the mock model), and
the paired comparison of two scorings."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from orchestrator.batch.compare import compare, mcnemar_exact
from orchestrator.batch.report import build_report
from orchestrator.batch.rescore import rescore
from orchestrator.cli.parser import build_parser
from tests.conftest import TEST_PAYLOADS, cli

MATH = TEST_PAYLOADS / "batch_math"

TASKS = [
    {"id": "mul", "task": "6*7?", "additional_args": {"op": "mul", "a": 6, "b": 7}, "expected": 42},
    {
        "id": "off-by-one",
        "task": "1+2?",
        "additional_args": {"op": "add", "a": 1, "b": 2},
        "expected": 4,
    },
    {
        "id": "add",
        "task": "2+2?",
        "additional_args": {"op": "add", "a": 2, "b": 2},
        "expected": "4.0",
    },
    {"id": "loops", "task": "loop", "additional_args": {"op": "loop"}, "expected": 1},
    {"id": "no-expected", "task": "2*3?", "additional_args": {"op": "mul", "a": 2, "b": 3}},
]


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory: pytest.TempPathFactory, agent_image: str) -> Path:
    """One real batch (the old `batch PAYLOAD TASKS -o DIR` form) for every test here."""
    root = tmp_path_factory.mktemp("report")
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    out = root / "out"
    done = cli("batch", str(MATH), str(tasks), "-o", str(out), "--model", "mock", "-q")
    assert done.returncode == 0, done.stderr
    return out


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_report_lists_exactly_the_wrong_and_failed_tasks(batch_dir: Path, tmp_path: Path):
    done = cli("batch", "report", str(batch_dir), "--json", "--csv", str(tmp_path / "r.csv"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["counts"]["succeeded"] == 4 and report["counts"]["failed"] == 1
    assert report["scored"] == 4 and report["accuracy"] == 0.5
    low, high = report["accuracy_ci95"]
    assert 0.14 < low < 0.16 and 0.84 < high < 0.86  # Wilson, n=4, 2 right
    order = [(r["id"], r["verdict"]) for r in report["rows"]]
    assert order[:2] == [("loops", "failed"), ("off-by-one", "wrong")]
    assert {v for _, v in order[2:]} <= {"correct", "unscored"}
    rows = {r["id"]: r for r in report["rows"]}
    assert rows["off-by-one"]["answer"] == 3 and rows["off-by-one"]["expected"] == 4
    assert "max steps" in rows["loops"]["error"].lower()
    with open(tmp_path / "r.csv", newline="") as file:
        table = list(csv.DictReader(file))
    assert [r["id"] for r in table][:2] == ["loops", "off-by-one"] and len(table) == 5

    text = cli("batch", "report", str(batch_dir))
    assert text.returncode == 0, text.stderr
    listed = [
        line.split()[1]
        for line in text.stdout.splitlines()
        if line.startswith("  ") and line.split()[0] in ("FAILED", "WRONG", "PARTIAL")
    ]
    assert listed == ["loops", "off-by-one"], text.stdout
    assert "95% CI 15.0%–85.0%" in text.stdout


def test_rescore_changes_accuracy_and_leaves_results_alone(batch_dir: Path):
    before = digest(batch_dir / "results.jsonl")
    summary = digest(batch_dir / "summary.json")
    done = cli(
        "batch", "rescore", str(batch_dir), "--scorer", "numeric", "--tolerance", "0.5", "--json"
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    # |3 - 4| <= 0.5 * 4: the off-by-one answer is now right; the loop still scores 0.
    assert report["accuracy"] == 0.75 and report["scorer"] == "numeric"
    assert report["rescored_from"] == "exact"
    assert [r["id"] for r in report["rows"] if r["verdict"] != "correct"][:1] == ["loops"]
    written = json.loads((batch_dir / "summary.rescore-numeric.json").read_text())
    assert written["accuracy"] == 0.75 and written["tolerance"] == 0.5
    assert digest(batch_dir / "results.jsonl") == before
    assert digest(batch_dir / "summary.json") == summary

    scorer = batch_dir.parent / "strict.py"
    scorer.write_text("def never(answer, expected, task):\n    return task['id'] == 'nothing'\n")
    strict = cli("batch", "rescore", str(batch_dir), "--scorer", f"{scorer}:never")
    assert strict.returncode == 0, strict.stderr
    assert "accuracy  0.0% (0/4 scored" in strict.stdout, strict.stdout
    assert (batch_dir / "summary.rescore-strict-never.json").is_file()
    assert digest(batch_dir / "results.jsonl") == before


def test_bad_input_exits_2(batch_dir: Path, tmp_path: Path):
    missing = cli("batch", "report", str(tmp_path))
    assert missing.returncode == 2 and "not a batch output folder" in missing.stderr
    unknown = cli("batch", "rescore", str(batch_dir), "--scorer", "nope")
    assert unknown.returncode == 2 and "Unknown scorer" in unknown.stderr
    no_scorer = cli("batch", "rescore", str(batch_dir))
    assert no_scorer.returncode == 2 and "--scorer" in no_scorer.stderr


def test_verbs_and_the_old_form_parse_side_by_side():
    parser = build_parser()
    old = parser.parse_args(["batch", "payload", "tasks.jsonl", "-o", "out", "--json"])
    assert (old.payload, old.tasks, old.output, old.json) == ("payload", "tasks.jsonl", "out", True)
    report = parser.parse_args(["batch", "report", "out", "--csv", "x.csv"])
    assert (report.dir, report.csv, report.handler.__name__) == ("out", "x.csv", "cmd_report")
    again = parser.parse_args(["batch", "rescore", "out", "--scorer", "contains"])
    assert (again.dir, again.scorer, again.handler.__name__) == ("out", "contains", "cmd_rescore")
    # A payload folder called "report" still runs as a payload when written as a path.
    path = parser.parse_args(["batch", "./report", "tasks.jsonl", "-o", "out"])
    assert path.payload == "./report" and path.handler.__name__ == "cmd_batch"


def test_mcnemar_exact_and_comparison(batch_dir: Path):
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(1, 6) == pytest.approx(0.125)  # 2 * (1 + 7) / 2**7
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    original = build_report(batch_dir)
    rescored = rescore(batch_dir, "numeric", tolerance=0.5)
    result = compare(original, rescored)
    assert result.paired == 4
    assert [f["id"] for f in result.to_right] == ["off-by-one"] and not result.to_wrong
    assert result.difference == pytest.approx(0.25) and result.p_value == 1.0
