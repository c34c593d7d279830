"""`batch --epochs N`: each (task, epoch) its own attempt and result line, resumed exactly
once; the reducers (pass@k, mean, max, mode) and the clustered standard error in the summary
and the report; `batch compare` saying whether two batches differ. Most tests use a stand-in
executor (no sandbox); one runs the whole thing in real sandboxes against the scripted model
server, killed with SIGKILL mid-way and resumed."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchestrator.batch import BatchSpec, run_batch
from orchestrator.batch.report import build_report
from orchestrator.errors import ConfigError
from orchestrator.execution.executor import Attempt, AttemptExecutor
from orchestrator.lifecycle.runner import RunObservers
from orchestrator.spec import RunResult, RunSpec
from tests.conftest import TEST_PAYLOADS, cli, start_cli, wait_for
from tests.model_server import ScriptedModelServer
from tests.test_gateway import model_key  # noqa: F401 - a fixture

MATH = TEST_PAYLOADS / "batch_math"
EPOCHS = 5
TASKS = 20


def right_in(i: int) -> int:
    """How many of its 5 epochs task i answers right: 0, 1, ..., 5, 0, 1, ..."""
    return i % 6


#: The closed-form values for `right_in` over 20 tasks: pass@1 is the share of right epochs
#: (46 of 100); pass@5 the share of tasks right at least once (all but t00, t06, t12, t18).
PASS_AT_1, PASS_AT_5 = 46 / 100, 16 / 20


def closed_form(n: int) -> tuple[float, float]:
    """pass@1 and pass@5 of `right_in` over `n` tasks (PASS_AT_1, PASS_AT_5 for 20)."""
    return sum(right_in(i) for i in range(n)) / (n * EPOCHS), sum(
        right_in(i) > 0 for i in range(n)
    ) / n


#: Sandboxes the real-sandbox test starts: 6 tasks x 5 epochs, one whole cycle of `right_in`
#: (the 20 x 5 of the acceptance run with a stand-in executor above it; the statistics are
#: the same code).
SANDBOX_TASKS = 6


def write_tasks(path: Path, n: int = TASKS) -> Path:
    rows = [
        {"id": f"t{i:02d}", "task": f"[t{i:02d}] answer", "expected": "right"} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Answers:
    """Task i's answers in turn: `right` for the first `right_in(i)` of every 5, else
    `wrong` (shared by the sessions of a batch, so a resume goes on where it stopped)."""

    def __init__(self) -> None:
        self.given: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, text: str) -> str:
        task = re.search(r"\[(t\d+)\]", text)
        assert task, text
        with self.lock:
            turn = self.given[task[1]] % EPOCHS
            self.given[task[1]] += 1
        return "right" if turn < right_in(int(task[1][1:])) else "wrong"


class EpochExecutor(AttemptExecutor):
    """Starts no sandbox: answers from `answers`; after `cancel_after` attempts, every other
    attempt ends `cancelled` (as in an interrupted session), answering nothing."""

    def __init__(self, answers: Answers, cancel_after: int | None = None) -> None:
        self.answers = answers
        self.cancel_after = cancel_after
        self.ran = 0
        self.lock = threading.Lock()

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        if attempt.prepared.spec.check_only:
            return RunResult(run_id=attempt.run_id, status="succeeded")
        with self.lock:
            self.ran += 1
            cut = self.cancel_after is not None and self.ran > self.cancel_after
        if cut:
            return RunResult(attempt.run_id, "cancelled", record_dir="")
        answer = self.answers(attempt.prepared.task)
        assert observers.store is not None
        record = str(observers.store.create_run(attempt.run_id, status="running"))
        observers.store.update_run(attempt.run_id, status="succeeded", ended_at=time.time())
        return RunResult(attempt.run_id, "succeeded", answer=answer, record_dir=record)


def units(rows: list[dict[str, Any]]) -> Counter[tuple[str, int]]:
    return Counter((r["id"], r.get("epoch", 1)) for r in rows)


def check_epochs(summary: dict[str, Any], out: Path, *, exact: bool = True, n: int = TASKS) -> None:
    """Every (task, epoch) recorded once, with an attempt that answered (exactly one unless
    a SIGKILL fell between an attempt's end line and its result line); pass@1 and pass@5
    within their standard error of the closed-form values (`exact`: equal to them, as
    nothing was answered and then lost)."""
    results = lines_of(out / "results.jsonl")
    every = {(f"t{i:02d}", e) for i in range(n) for e in range(1, EPOCHS + 1)}
    assert units(results) == Counter(every)  # each (task, epoch) exactly once
    attempts = lines_of(out / "attempts.jsonl")
    assert all("epoch" in a for a in attempts)
    ran = units([a for a in attempts if a["event"] == "end" and a["status"] == "succeeded"])
    assert set(ran) == every and (not exact or ran == Counter(every)), ran
    right = Counter(r["id"] for r in results if r["score"] == 1.0)
    assert summary["state"] == "complete" and summary["pending"] == 0
    assert summary["total"] == n and summary["epochs"] == EPOCHS
    assert summary["scored"] == n * EPOCHS
    metrics = summary["epoch_metrics"]["reducers"]
    assert set(metrics) == {"mean", "max", "mode", *(f"pass_at_{k}" for k in range(1, 6))}
    for k, closed in zip((1, 5), closed_form(n), strict=True):
        figure = metrics[f"pass_at_{k}"]
        assert abs(figure["value"] - closed) <= figure["stderr"], (k, figure)
        assert not exact or figure["value"] == pytest.approx(closed)
    # The estimator over what was recorded, by hand: 1 - C(5-c, k)/C(5, k) per task.
    for k in range(1, EPOCHS + 1):
        by_hand = [1 - math.comb(5 - right[f"t{i:02d}"], k) / math.comb(5, k) for i in range(n)]
        assert metrics[f"pass_at_{k}"]["value"] == pytest.approx(sum(by_hand) / n)
    assert summary["accuracy"] == pytest.approx(sum(right.values()) / (n * EPOCHS))
    assert summary["accuracy_stderr"] > 0


def test_epochs_resume_each_task_epoch_exactly_once(tmp_path: Path) -> None:
    """20 tasks x 5 epochs, the first session cut after 37 attempts: the resume runs the
    other 63 (task, epoch) pairs once each; pass@1 and pass@5 are the closed-form values."""
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    out = tmp_path / "out"
    spec = BatchSpec(
        tasks=tasks, output=out, run=RunSpec(payload=MATH), concurrency=3, epochs=EPOCHS
    )
    assert closed_form(TASKS) == (PASS_AT_1, PASS_AT_5)
    answers = Answers()
    first = run_batch(spec, executor=EpochExecutor(answers, cancel_after=37))
    assert first.state == "interrupted" and first.pending == 100 - 37
    assert len(lines_of(out / "results.jsonl")) == 37
    second = run_batch(spec, executor=EpochExecutor(answers))
    check_epochs(second.to_dict(), out)
    assert sum(answers.given.values()) == 100  # no (task, epoch) answered twice
    assert json.loads((out / "batch.json").read_text())["options"]["epochs"] == EPOCHS
    assert sorted(p.name for p in (out / "runs" / "t03").iterdir()) == ["1", "2", "3", "4", "5"]
    with pytest.raises(ConfigError, match="epochs: 5 → 1"):
        run_batch(replace(spec, epochs=1), executor=EpochExecutor(answers))
    with pytest.raises(ConfigError, match="--epochs must be a whole number of at least 1"):
        run_batch(replace(spec, epochs=0), executor=EpochExecutor(answers))

    report = build_report(out)
    assert report.epochs == EPOCHS and len(report.rows) == 100 and len(report.tasks) == 20
    t03 = next(t for t in report.tasks if t["id"] == "t03")
    assert t03 == {
        "id": "t03",
        "epochs": 5,
        "passed": 3,
        "by_epoch": [1.0, 1.0, 1.0, 0.0, 0.0],
        "mean": 0.6,
        "max": 1.0,
        "mode": 1.0,
    }
    assert report.to_csv().splitlines()[0].startswith("id,epoch,line,")
    shown = cli("batch", "report", str(out))
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"pass@5  80\.0% ± \d+\.\d% SE \(20 tasks\)", shown.stdout), shown.stdout
    assert "std error" in shown.stdout and "(epoch " in shown.stdout


def test_one_epoch_writes_what_batches_always_wrote(tmp_path: Path) -> None:
    """--epochs 1 (the default): no `epoch` anywhere, batch.json's options as before, no
    reducers; a folder of before epochs resumes and reports."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", 4)
    out = tmp_path / "out"
    spec = BatchSpec(tasks=tasks, output=out, run=RunSpec(payload=MATH), concurrency=2)
    summary = run_batch(spec, executor=EpochExecutor(Answers(), cancel_after=2))
    summary = run_batch(spec, executor=EpochExecutor(Answers()))
    assert summary.state == "complete" and summary.epochs == 1 and summary.epoch_metrics == {}
    for path in ("results.jsonl", "attempts.jsonl"):
        assert not any("epoch" in line for line in lines_of(out / path))
    assert "epochs" not in json.loads((out / "batch.json").read_text())["options"]
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["t00", "t01", "t02", "t03"]
    report = build_report(out)
    assert report.epochs == 1 and report.tasks == [] and report.epoch_metrics == {}
    assert report.to_csv().splitlines()[0].startswith("id,line,verdict,")
    assert report.accuracy_stderr is not None


# --- batch compare over batch folders ----------------------------------------------------------


def fake_batch(folder: Path, scores: dict[str, list[float]]) -> Path:
    """A batch folder as a batch leaves it: batch.json and one result line per epoch."""
    folder.mkdir(parents=True)
    epochs = max(len(s) for s in scores.values())
    options = {"scorer": "exact", **({"epochs": epochs} if epochs > 1 else {})}
    meta = {"batch_id": f"b-{folder.name}", "options": options, "sessions": 1}
    (folder / "batch.json").write_text(json.dumps(meta))
    lines = []
    for line, (task_id, epoch_scores) in enumerate(scores.items(), 1):
        for epoch, score in enumerate(epoch_scores, 1):
            row = {"id": task_id, "line": line, "status": "succeeded", "score": score}
            row.update({"answer": str(score), "expected": "1", "run_id": f"r-{task_id}-{epoch}"})
            if epochs > 1:
                row["epoch"] = epoch
            lines.append(json.dumps(row) + "\n")
    (folder / "results.jsonl").write_text("".join(lines))
    return folder


def right_on(tasks: set[int], n: int = 40) -> dict[str, list[float]]:
    return {f"q{i:02d}": [1.0 if i in tasks else 0.0] for i in range(n)}


def compare_json(a: Path, b: Path) -> dict[str, Any]:
    done = cli("batch", "compare", str(a), str(b), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_compare_says_whether_a_difference_is_real(tmp_path: Path) -> None:
    """40 tasks: B 2.5 points better (3 gained, 2 lost) is not distinguishable (McNemar p =
    1); B 40 points better (16 gained) is, with the interval 0.4 ± 1.96·sqrt(9.6)/40."""
    a = fake_batch(tmp_path / "a", right_on(set(range(20))))
    close = fake_batch(tmp_path / "close", right_on(set(range(2, 23))))
    far = fake_batch(tmp_path / "far", right_on(set(range(36))))

    near = compare_json(a, close)
    assert near["paired"] == 40 and near["difference"] == pytest.approx(0.025)
    assert near["test"] == "mcnemar_exact" and near["p_value"] == 1.0
    assert near["verdict"] == "not distinguishable"
    assert near["ci95"][0] < 0 < near["ci95"][1]
    assert len(near["to_right"]) == 3 and len(near["to_wrong"]) == 2

    big = compare_json(a, far)
    half = 1.959964 * math.sqrt(9.6) / 40
    assert big["difference"] == pytest.approx(0.4) and big["verdict"] == "distinguishable"
    assert big["ci95"] == pytest.approx([0.4 - half, 0.4 + half])
    assert big["p_value"] == pytest.approx(2 / 2**16)

    text = cli("batch", "compare", str(a), str(far))
    assert text.returncode == 0, text.stderr
    assert "distinguishable (McNemar's exact test, p = 3.05e-05)" in text.stdout, text.stdout
    assert "+40.0%, 95% CI +24.8% to +55.2%" in text.stdout, text.stdout


def test_compare_with_epochs_pairs_the_tasks_means(tmp_path: Path) -> None:
    """Epochs: each task's epochs averaged, then the paired t test over tasks; 0.1 apart on
    every task but one is distinguishable, a 0.02 wobble is not."""
    base = {f"q{i:02d}": [0.0, 1.0, 1.0, 0.0, 1.0] for i in range(40)}  # 0.6 each
    better = {k: [1.0, 1.0, 1.0, 0.0, 1.0] for k in base}  # 0.8 each
    better["q00"] = [0.0, 1.0, 1.0, 0.0, 1.0]
    a = fake_batch(tmp_path / "a", base)
    b = fake_batch(tmp_path / "b", better)
    result = compare_json(a, b)
    assert result["test"] == "paired_t" and result["verdict"] == "distinguishable"
    assert result["difference"] == pytest.approx(0.2 * 39 / 40)
    assert result["ci95"][0] < result["difference"] < result["ci95"][1]
    wobble = {k: [0.0, 1.0, 1.0, 0.0, 1.0] for k in base}
    wobble["q01"] = [1.0, 1.0, 1.0, 0.0, 1.0]
    assert compare_json(a, fake_batch(tmp_path / "w", wobble))["verdict"] == "not distinguishable"


def test_the_viewer_shows_the_epochs_reducers(tmp_path: Path) -> None:
    """A batch page (exported, no server) of a batch with epochs: the reducers with their
    standard errors, the clustered standard error, each row's epoch."""
    folder = fake_batch(tmp_path / "a", {f"q{i}": [0.0, 1.0, 1.0, 0.0, 1.0] for i in range(4)})
    done = cli("view", "--export", str(tmp_path / "html"), str(folder))
    assert done.returncode == 0, done.stderr
    page = re.sub(r"<[^>]+>", "", (tmp_path / "html" / "batch-b-a.html").read_text())
    assert "5 per task: mean 60.0% ± 0.0% · max 100.0%" in page, page
    assert "pass@2 90.0%" in page and "(clustered by task)" in page and "epoch 5" in page
    # Each task's epochs side by side: one row per task, a cell per epoch in epoch order.
    html = (tmp_path / "html" / "batch-b-a.html").read_text()
    table = html.split('id="epochs-by-task"', 1)[1].split("</table>", 1)[0]
    rows = [re.sub(r"<[^>]+>", " ", r).split() for r in table.split("<tr>")[2:]]
    assert rows == [[f"q{i}", "0", "1", "1", "0", "1", "3/5", "0.60"] for i in range(4)], rows


# --- in real sandboxes, the scripted model server, SIGKILL and resume ---------------------------


@pytest.mark.docker
@pytest.mark.usefixtures("model_key", "nothing_left")
def test_epochs_in_sandboxes_killed_and_resumed(tmp_path: Path, agent_image: str) -> None:
    """6 tasks x 5 epochs, each attempt its own sandbox asking the scripted server (task i
    right in i % 6 of its epochs); SIGKILLed once 10 results are in, then the same command
    finishes each (task, epoch) exactly once."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", SANDBOX_TASKS)
    out = tmp_path / "out"
    answers = Answers()

    def reply(body: dict[str, Any]) -> str:
        word = answers(json.dumps(body.get("messages")))
        return f'Thought: I answer.\n<code>\nfinal_answer("{word}")\n</code>'

    with ScriptedModelServer([], answer=reply) as server:
        command = ["batch", str(MATH), str(tasks), "-o", str(out), "--epochs", str(EPOCHS)]
        # No gateway (one container less per attempt): the sandbox calls the server itself.
        command += ["-j", "3", "--model", "openai:scripted", "--no-gateway", "--network", "open"]
        command += ["--api-base", server.api_base("172.17.0.1")]
        proc = start_cli(*command, "-q")
        try:
            results = out / "results.jsonl"
            wait_for(lambda: results.is_file() and len(results.read_text().splitlines()) >= 10, 600)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        before = units(lines_of(results))
        assert 10 <= sum(before.values()) < SANDBOX_TASKS * EPOCHS
        done = cli(*command, "-q", "--json", timeout=900)
        assert done.returncode == 0, (done.stderr, proc.stderr)
    summary = json.loads(done.stdout)
    check_epochs(summary, out, exact=False, n=SANDBOX_TASKS)
    again = {
        (a["id"], a["epoch"])
        for a in lines_of(out / "attempts.jsonl")
        if a["event"] == "start" and a["session"] == 2
    }
    assert again and not again & set(before)  # nothing recorded before the kill ran again
