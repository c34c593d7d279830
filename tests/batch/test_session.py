"""Batch evaluation: parsing and scoring (pure), then whole batches in real containers."""

from __future__ import annotations

import http.server
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.batch import (
    BatchDir,
    BatchObservers,
    BatchSpec,
    TaskFileError,
    derive_id,
    make_scorer,
    percentile,
    read_tasks,
    run_batch,
    wilson_interval,
)
from orchestrator.errors import ConfigError
from orchestrator.execution.executor import Attempt, AttemptExecutor
from orchestrator.labels import LABEL_RUN_ID
from orchestrator.lifecycle.runner import PreparedRun, RunObservers
from orchestrator.records.store import Store
from orchestrator.spec import RunError, RunResult, RunSpec
from tests.conftest import REPO, TEST_PAYLOADS, cli, our_containers, wait_for

MATH = TEST_PAYLOADS / "batch_math"


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def math_rows(n: int, *, start: int = 0, wrong: tuple[int, ...] = ()) -> list[dict]:
    """Arithmetic tasks with per-task expected answers; those in `wrong` are off by one."""
    rows = []
    for i in range(start, start + n):
        a, b = i + 2, i % 5 + 3
        op = "mul" if i % 2 == 0 else "add"
        expected = a * b if op == "mul" else a + b
        rows.append(
            {
                "id": f"q{i:03d}",
                "task": f"What is {a} {'*' if op == 'mul' else '+'} {b}?",
                "additional_args": {"op": op, "a": a, "b": b},
                "expected": expected + (1 if i in wrong else 0),
            }
        )
    return rows


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- tasks files (no Docker) ----------------------------------------------------------------


def test_jsonl_fields_overrides_and_derived_ids(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"id": 7, "task": "a", "expected": "x", "max_steps": 2, "timeout": 30},
            "",
            {"task": "b", "additional_args": {"k": [1, 2]}, "metadata": {"topic": "t"}},
        ],
    )
    first, second = read_tasks(path).tasks
    assert (first.id, first.line) == ("7", 1)
    assert first.overrides == {"max_steps": 2, "timeout_seconds": 30.0}
    assert second.line == 3 and second.expected is None
    # A derived id depends on what is run, not on where the line is or how it is written.
    assert second.id == derive_id("b", {"k": [1, 2]}) == derive_id("b", {"k": [1, 2]})
    assert second.id != derive_id("b", {"k": [2, 1]})


def test_csv_with_args_columns(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "id,task,args.a,args.op,expected,max_steps\n"
        'x,"multi\nline task",6,mul,42,\n'
        'y,second,"""text""",add,,4\n'
    )
    x, y = read_tasks(path).tasks
    assert x.additional_args == {"a": 6, "op": "mul"} and x.expected == "42" and not x.overrides
    assert x.task == "multi\nline task" and x.line == 2
    assert y.line == 4 and y.additional_args == {"a": "text", "op": "add"}
    assert y.overrides == {"max_steps": 4} and y.expected is None


def test_malformed_lines_are_named_and_skippable(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"id": "a", "task": "ok"}, "{not json", {"id": "c"}, ["x"], {"task": "d", "expcted": 1}],
    )
    with pytest.raises(TaskFileError) as info:
        read_tasks(path)
    message = info.value.cause
    for line, words in ((2, "not valid JSON"), (3, "`task`"), (4, "JSON object"), (5, "expcted")):
        assert f"{path}:{line}: " in message and words in message, message
    skipped = read_tasks(path, on_bad_line="skip")
    assert [t.id for t in skipped.tasks] == ["a"]
    assert [b.line for b in skipped.bad_lines] == [2, 3, 4, 5]


def test_duplicate_ids_name_both_lines(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"id": "a", "task": "x"},
            {"id": "b", "task": "y"},
            {"id": "a", "task": "z"},
            {"task": "same"},
            {"task": "same"},
        ],
    )
    with pytest.raises(TaskFileError) as info:
        read_tasks(path, on_bad_line="skip")  # duplicates are an error even when skipping
    assert f"{path}:3: duplicate id 'a' (first on line 1)" in info.value.cause
    assert f"{path}:5: repeats the task and additional_args of line 4" in info.value.cause


def test_csv_unknown_column_and_ragged_row(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("id,task,answr\n1,a,b\n")
    with pytest.raises(TaskFileError, match="t.csv:1: unknown column"):
        read_tasks(path)
    path.write_text("id,task\n1,a\n2,b,extra\n")
    with pytest.raises(TaskFileError, match=r"t.csv:3: has 3 fields"):
        read_tasks(path)


def test_every_problem_of_every_line_is_named_before_anything_starts(tmp_path: Path) -> None:
    """A tasks file with problems on two lines: `batch` exits 2 naming both lines
    and every field at fault on each (did you mean, the limit's range); --json carries each
    problem with its line and field. No Docker: the file is refused before anything starts."""
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"id": "a", "task": "ok"},
            {"task": "two", "max_step": 3, "memory_mb": "lots"},
            {"id": "c", "task": "three"},
            {"task": "four", "timeout": 0, "additional_args": [1]},
        ],
    )
    out = tmp_path / "out"
    refused = cli("batch", str(MATH), str(path), "-o", str(out))
    assert refused.returncode == 2 and not out.exists(), refused.stderr
    assert f"{path} has 2 malformed line(s):" in refused.stderr
    assert (
        f"{path}:2: `max_step` is not a known field; did you mean `max_steps`? (known fields: "
        in refused.stderr
    )
    assert "; `memory_mb` must be an integer, got 'lots' (use 64 to 65536 MiB)" in refused.stderr
    assert (
        f"{path}:4: `timeout_seconds` is 0, out of range (use 1 to 86400 seconds); "
        "`additional_args` must be a JSON object, got a JSON array" in refused.stderr
    )
    as_json = cli("batch", str(MATH), str(path), "-o", str(out), "--json")
    assert as_json.returncode == 2 and not out.exists()
    problems = json.loads(as_json.stdout)["error"]["problems"]
    assert [(p["line"], p["field"]) for p in problems] == [
        (2, "max_step"),
        (2, "memory_mb"),
        (4, "timeout_seconds"),
        (4, "additional_args"),
    ]
    assert all(p["fix"] for p in problems)


# --- scoring (no Docker) --------------------------------------------------------------------


def test_scorers(tmp_path: Path) -> None:
    exact = make_scorer("exact")
    assert exact(" Paris. ", "paris", {}) == 1.0
    assert exact('"Frank  Herbert"', "frank herbert", {}) == 1.0
    assert exact("Lyon", ["Paris", "Lyon"], {}) == 1.0
    assert exact("Paris, France", "Paris", {}) == 0.0
    assert exact(42.0, "42", {}) == 1.0 and exact("4.20", 4.2, {}) == 1.0
    assert make_scorer("contains")("It is Paris, France.", "paris", {}) == 1.0
    numeric = make_scorer("numeric", tolerance=0.01)
    assert numeric("The answer is 1,234.5", 1234, {}) == 1.0  # within 1 % of 1234
    assert numeric(42, "42.0", {}) == 1.0 and numeric("about 41", 42, {}) == 0.0
    assert numeric("no number", 1, {}) == 0.0
    (tmp_path / "my_scorer.py").write_text(
        "def score(answer, expected, task):\n    return len(str(answer)) == task['metadata']['n']\n"
    )
    user = make_scorer(f"{tmp_path / 'my_scorer.py'}:score")
    assert user("abc", None, {"metadata": {"n": 3}}) == 1.0
    with pytest.raises(ConfigError, match="no function"):
        make_scorer(f"{tmp_path / 'my_scorer.py'}:nope")
    with pytest.raises(ConfigError, match="Unknown scorer"):
        make_scorer("fuzzy")


def test_wilson_interval_and_percentiles() -> None:
    low, high = wilson_interval(8, 10)
    assert round(low, 3) == 0.490 and round(high, 3) == 0.943
    assert wilson_interval(0, 5)[0] == 0.0 and wilson_interval(5, 5)[1] == 1.0
    assert percentile([4, 1, 3, 2], 50) == 2.5 and percentile([1.0], 95) == 1.0
    assert percentile([], 50) is None


def test_torn_last_line_is_dropped(tmp_path: Path) -> None:
    out = BatchDir(tmp_path)
    out.append_result({"id": "a", "status": "succeeded"})
    with open(out.results_path, "a") as file:
        file.write('{"id": "b", "sta')  # what a SIGKILL mid-write could leave
    assert list(out.load_results()) == [("a", 1)]  # (task id, epoch)
    assert lines_of(out.results_path) == [{"id": "a", "status": "succeeded"}]


# --- batches in real containers -------------------------------------------------------------


def task_sandboxes(docker_client, store_label: str) -> list[dict]:
    """Sandboxes of batch tasks (not the batch's up-front payload check, which has no batch)."""
    return [
        c
        for c in our_containers(docker_client, store_label)
        if (Store().get_run(c["Labels"][LABEL_RUN_ID]) or {}).get("batch")
    ]


docker = pytest.mark.docker


def batch_cmd(tasks: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "orchestrator",
        "batch",
        str(MATH),
        str(tasks),
        "-o",
        str(out),
        *extra,
    ]


@docker
def test_ten_tasks_statuses_scores_and_summary(
    tmp_path: Path, agent_image: str, docker_client, store_label, no_leftovers
) -> None:
    """Acceptance 1 (and the max-steps half of 3) at concurrency 4: ten tasks give every
    status, right and wrong scores, an unscored and a derived id, as thirty did."""
    rows = math_rows(5, wrong=(1, 3))
    rows.append(
        {
            "id": "slow",
            "task": "sleep",
            "additional_args": {"op": "sleep", "seconds": 30},
            "expected": "woke",
            "timeout_seconds": 3,
        }
    )
    rows += [
        {
            "id": f"loop{i}",
            "task": "never answers",
            "additional_args": {"op": "loop"},
            "expected": "x",
            "max_steps": 2,
        }
        for i in range(2)
    ]
    rows += [{"id": "noexp", "task": "mul", "additional_args": {"op": "mul", "a": 2, "b": 2}}]
    rows += [{"task": "derived", "additional_args": {"op": "add", "a": 2, "b": 2}, "expected": 4}]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", rows)
    out = tmp_path / "out"
    seen: list[dict] = []
    started = time.monotonic()
    summary = run_batch(
        BatchSpec(tasks=tasks, output=out, run=RunSpec(payload=MATH), concurrency=4),
        observers=BatchObservers(on_result=seen.append),
    )
    wall = time.monotonic() - started
    results = {r["id"]: r for r in lines_of(out / "results.jsonl")}
    assert len(lines_of(out / "results.jsonl")) == len(results) == 10 == len(seen)
    for row in rows[:5]:
        got = results[row["id"]]
        assert got["status"] == "succeeded", got
        assert got["answer"] == row["additional_args"]["a"] * row["additional_args"]["b"] or (
            got["answer"] == row["additional_args"]["a"] + row["additional_args"]["b"]
        )
        wrong = row["id"] in ("q001", "q003")
        assert got["score"] == (0.0 if wrong else 1.0), got
        assert got["attempts"] == 1 and got["tokens"]["input"] > 0
        assert Path(got["record_dir"], "result.json").is_file()
        assert (out / "runs" / row["id"]).resolve() == Path(got["record_dir"]).resolve()
    assert results["slow"]["status"] == "timed_out" and results["slow"]["score"] == 0.0
    for name in ("loop0", "loop1"):  # max steps: a failed result, not retried
        got = results[name]
        assert got["status"] == "failed" and got["attempts"] == 1 and got["score"] == 0.0
        assert "max" in json.dumps(got["error"]).lower(), got["error"]
    assert results["noexp"]["status"] == "succeeded" and results["noexp"]["score"] is None
    assert results[derive_id("derived", {"op": "add", "a": 2, "b": 2})]["score"] == 1.0

    saved = json.loads((out / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary.to_dict()))
    assert summary.state == "complete" and summary.exit_code == 0
    assert sum(summary.counts.values()) + summary.pending == summary.total == 10
    assert summary.counts == {
        "succeeded": 7,
        "failed": 2,
        "timed_out": 1,
        "oom_killed": 0,
        "infra_error": 0,
    }
    assert summary.scored == 9 and summary.correct == 4
    assert summary.accuracy == pytest.approx(4 / 9)
    low, high = summary.accuracy_ci95
    assert low < 4 / 9 < high
    assert summary.duration_p50 <= summary.duration_p95
    assert summary.retries == 0 and summary.attempts == 10
    assert summary.tokens["input"] == sum(r["tokens"]["input"] for r in results.values())
    runs = Store().list_runs(limit=100, batch=summary.batch_id)
    assert len(runs) == 10
    print(f"10 tasks at concurrency 4: {wall:.1f}s wall")


@docker
def test_resume_reruns_only_what_is_unfinished(tmp_path: Path, agent_image: str, no_leftovers):
    rows = math_rows(2) + [
        {
            "id": "loop",
            "task": "t",
            "additional_args": {"op": "loop"},
            "expected": "x",
            "max_steps": 2,
        }
    ]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", rows)
    out = tmp_path / "out"
    first = cli(*batch_cmd(tasks, out)[3:])
    assert first.returncode == 0, first.stderr
    before = {r["id"]: r for r in lines_of(out / "results.jsonl")}
    known = {r["run_id"] for r in Store().list_runs(limit=0, kind=None)}
    again = cli(*batch_cmd(tasks, out)[3:])
    assert again.returncode == 0, again.stderr
    assert {r["id"]: r for r in lines_of(out / "results.jsonl")} == before  # nothing re-run
    started = [r for r in Store().list_runs(limit=0, kind=None) if r["run_id"] not in known]
    assert started == []  # not even the preflight's check: nothing was left to run
    rerun = cli(*batch_cmd(tasks, out, "--rerun-failed", "--json")[3:])
    assert rerun.returncode == 0, rerun.stderr
    after = lines_of(out / "results.jsonl")
    assert sorted(r["id"] for r in after) == sorted(before)  # still one line per task
    changed = [r["id"] for r in after if r["run_id"] != before[r["id"]]["run_id"]]
    assert changed == ["loop"]
    assert json.loads(rerun.stdout)["session"]["tasks_run"] == 1
    # Other options on the same directory would mix results: refused, nothing run.
    other = cli(*batch_cmd(tasks, out, "--max-steps", "5")[3:])
    assert other.returncode == 2 and "max_steps" in other.stderr, other.stderr
    # One batch at a time per directory.
    with BatchDir(out).locked():
        locked = cli(*batch_cmd(tasks, out)[3:])
    assert locked.returncode == 2 and "Another batch" in locked.stderr


@docker
def test_sigkill_then_same_command_finishes_each_task_once(
    tmp_path: Path, agent_image: str, docker_client, store_label, no_leftovers
) -> None:
    """Acceptance 2: killed mid-task, four or more of eight tasks answered."""
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(8))
    out = tmp_path / "out"
    command = batch_cmd(tasks, out, "--concurrency", "2")
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        results = out / "results.jsonl"
        wait_for(lambda: results.is_file() and len(results.read_text().splitlines()) >= 4, 180)
        wait_for(lambda: task_sandboxes(docker_client, store_label), 30)  # kill mid-task
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    snapshot = {r["id"]: r for r in lines_of(results)}
    assert 4 <= len(snapshot) < 8
    second = cli(*command[3:])
    assert second.returncode == 0, second.stderr
    final = lines_of(results)
    assert sorted(r["id"] for r in final) == [f"q{i:03d}" for i in range(8)]  # each once
    for row in final:
        if row["id"] in snapshot:
            assert row == snapshot[row["id"]]  # finished before the kill: kept as it was
        assert row["status"] == "succeeded" and row["score"] == 1.0
    attempts = lines_of(out / "attempts.jsonl")
    rerun = {a["id"] for a in attempts if a["event"] == "start" and a["session"] == 2}
    assert rerun and not rerun & set(snapshot)  # no finished task was run again
    assert not our_containers(docker_client, store_label)
    # The attempts the kill cut short were closed in the store by the resumed batch's cleanup.
    cut = {a["run_id"] for a in attempts if a["event"] == "start" and a["session"] == 1} - {
        a["run_id"] for a in attempts if a["event"] == "end"
    }
    for run_id in cut:  # (no row if the kill came between the start line and the run's start)
        row = Store().get_run(run_id)
        assert row is None or row["status"] == "infra_error"
    # ... and are part of their task's attempt history, as lost.
    lost = {a["run_id"] for r in final for a in r["attempt_history"] if a["status"] == "lost"}
    assert lost == cut


@docker
def test_container_killed_from_outside_is_retried(
    tmp_path: Path, agent_image: str, docker_client, store_label, no_leftovers
) -> None:
    """Acceptance 3: a sandbox that vanishes is an infrastructure fault; the retry answers."""
    tasks = write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            {
                "id": "s",
                "task": "sleep",
                "additional_args": {"op": "sleep", "seconds": 4},
                "expected": "woke",
            }
        ],
    )
    box: dict = {}
    spec = BatchSpec(
        tasks=tasks, output=tmp_path / "out", run=RunSpec(payload=MATH), backoff_seconds=0.2
    )
    thread = threading.Thread(target=lambda: box.update(summary=run_batch(spec)))
    thread.start()
    try:
        victim = wait_for(lambda: task_sandboxes(docker_client, store_label), 120)[0]
        time.sleep(1)
        docker_client.api.kill(victim["Id"])
    finally:
        thread.join(timeout=120)
    (row,) = lines_of(tmp_path / "out" / "results.jsonl")
    assert row["status"] == "succeeded" and row["answer"] == "woke" and row["score"] == 1.0
    assert row["attempts"] == 2
    first, second = row["attempt_history"]
    assert first["status"] == "infra_error" and first["run_id"] == victim["Labels"][LABEL_RUN_ID]
    assert second["run_id"] == row["run_id"]
    assert Store().get_run(first["run_id"])["status"] == "infra_error"
    assert box["summary"].retries == 1 and box["summary"].counts["succeeded"] == 1


@docker
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_cleanly_and_keeps_results(
    sig: signal.Signals, tmp_path: Path, agent_image: str, docker_client, store_label, no_leftovers
) -> None:
    """Acceptance 4."""
    slow = [
        {"id": f"slow{i}", "task": "sleep", "additional_args": {"op": "sleep", "seconds": 60}}
        for i in range(4)
    ]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(3) + slow)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        batch_cmd(tasks, out, "--concurrency", "2"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        results = out / "results.jsonl"
        wait_for(lambda: results.is_file() and len(results.read_text().splitlines()) == 3, 180)
        wait_for(lambda: len(task_sandboxes(docker_client, store_label)) == 2, 60)
        time.sleep(1)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert not our_containers(docker_client, store_label)
    assert sorted(r["id"] for r in lines_of(results)) == ["q000", "q001", "q002"]
    assert all(r["status"] == "succeeded" for r in lines_of(results))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "interrupted" and summary["pending"] == 4
    assert "resume with: orchestrator batch" in stderr
    cancelled = [a for a in lines_of(out / "attempts.jsonl") if a.get("status") == "cancelled"]
    assert len(cancelled) == 2


#: A program that calls the Python API in its main thread, as a script or a notebook does.
API_CALLER = """
import sys
from pathlib import Path
from orchestrator.batch import BatchSpec, run_batch
from orchestrator.spec import RunSpec
tasks, out, payload = map(Path, sys.argv[1:4])
run_batch(BatchSpec(tasks=tasks, output=out, run=RunSpec(payload=payload), concurrency=2))
print("run_batch returned")
"""


@docker
def test_ctrl_c_in_the_python_api_stops_the_batch_and_raises(
    tmp_path: Path, agent_image: str, docker_client, store_label, no_leftovers
) -> None:
    """run_batch's promise: Ctrl-C stops the batch, removes every sandbox it started (warm
    ones too), writes an `interrupted` summary and raises KeyboardInterrupt to the caller: a
    program that went on as if the batch had ended (a benchmark's next batch) would be
    wrong. The instant a container is made: tests/lifecycle/test_interrupts.py."""
    slow = [
        {"id": f"slow{i}", "task": "sleep", "additional_args": {"op": "sleep", "seconds": 60}}
        for i in range(4)
    ]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", slow)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", API_CALLER, str(tasks), str(out), str(MATH)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: len(task_sandboxes(docker_client, store_label)) == 2, 180)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert "run_batch returned" not in stdout
    # Python ends a program that a KeyboardInterrupt ended by the same signal (-SIGINT).
    assert proc.returncode == -signal.SIGINT, stderr
    assert stderr.rstrip().endswith("KeyboardInterrupt"), stderr
    assert not our_containers(docker_client, store_label)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "interrupted" and summary["pending"] == 4


@docker
def test_bad_input_is_named_and_starts_nothing(
    tmp_path: Path, agent_image: str, docker_client, store_label, no_leftovers
) -> None:
    """Acceptance 5, through the command line."""
    good = math_rows(2)
    malformed = write_jsonl(tmp_path / "bad.jsonl", [good[0], '{"id": "x", "task": ', good[1]])
    out = tmp_path / "out"
    refused = cli(*batch_cmd(malformed, out)[3:])
    assert refused.returncode == 2
    assert refused.stderr.startswith("orchestrator: error: ")
    assert f"{malformed}:2: not valid JSON" in refused.stderr
    assert "--on-bad-line skip" in refused.stderr and "Traceback" not in refused.stderr
    dupes = write_jsonl(tmp_path / "dupes.jsonl", [good[0], good[1], good[0]])
    refused = cli(*batch_cmd(dupes, out, "--on-bad-line", "skip")[3:])
    assert refused.returncode == 2
    assert f"{dupes}:3: duplicate id 'q000' (first on line 1)" in refused.stderr
    assert not out.exists() and not our_containers(docker_client, store_label)
    # A per-task limit out of range is a bad line too, found before anything starts.
    limits = write_jsonl(tmp_path / "limits.jsonl", [good[0], {**good[1], "memory_mb": 1}])
    refused = cli(*batch_cmd(limits, out)[3:])
    assert (
        refused.returncode == 2
        and f"{limits}:2: " in refused.stderr
        and "memory_mb" in (refused.stderr)
    )
    skipped = cli(*batch_cmd(malformed, out, "--on-bad-line", "skip", "--json")[3:])
    assert skipped.returncode == 0, skipped.stderr
    summary = json.loads(skipped.stdout)
    assert summary["counts"]["succeeded"] == 2
    assert (
        summary["skipped_lines"] == [{"line": 2, "message": summary["skipped_lines"][0]["message"]}]
        and "not valid JSON" in summary["skipped_lines"][0]["message"]
    )


@pytest.fixture
def unavailable_model() -> Iterator[dict]:
    """A host-side model endpoint that answers every request with 503, reachable from the
    default bridge: the runtime reports `model_unavailable`, an infrastructure fault."""
    hits = {"count": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's naming
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            hits["count"] += 1
            body = b'{"error": {"message": "overloaded"}}'
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"api_base": f"http://172.17.0.1:{server.server_address[1]}/v1", "hits": hits}
    server.shutdown()
    server.server_close()


@docker
def test_model_5xx_is_retried_and_fail_on_error_stops(
    tmp_path: Path,
    agent_image: str,
    unavailable_model: dict,
    monkeypatch: pytest.MonkeyPatch,
    no_leftovers,
) -> None:
    """429/5xx from the model endpoint: retried with backoff, every attempt recorded; once
    more than 20 % of the tasks end in infra_error the batch stops and exits non-zero."""
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(5))
    run = RunSpec(
        payload=MATH,
        model="openai:scripted",
        api_base=unavailable_model["api_base"],
        network="open",
        model_options={"client_kwargs": {"max_retries": 0}},
    )
    spec = BatchSpec(
        tasks=tasks,
        output=tmp_path / "out",
        run=run,
        concurrency=1,
        max_attempts=2,
        backoff_seconds=0.1,
        fail_on_error=0.2,
    )
    summary = run_batch(spec)
    assert summary.state == "stopped" and summary.exit_code == 5
    assert summary.counts["infra_error"] == 2 and summary.pending == 3
    rows = lines_of(tmp_path / "out" / "results.jsonl")
    assert [r["id"] for r in rows] == ["q000", "q001"]
    for row in rows:
        assert row["status"] == "infra_error" and row["attempts"] == 2 and row["score"] is None
        assert row["error"]["kind"] == "model_unavailable", row["error"]
        assert [a["status"] for a in row["attempt_history"]] == ["infra_error"] * 2
    assert unavailable_model["hits"]["count"] >= 4
    ends = [a for a in lines_of(tmp_path / "out" / "attempts.jsonl") if a["event"] == "end"]
    assert len(ends) == 4 and summary.retries == 2


class StandInExecutor(AttemptExecutor):
    """An executor that starts no sandbox: the first attempt of each task in `flaky` (by its
    text) is an infrastructure fault, every other attempt succeeds with the right answer."""

    def __init__(self, flaky: set[str]) -> None:
        self.flaky = flaky
        self.opened: list[tuple[int, int]] = []
        self.closed = 0
        self.attempts: list[tuple[str, int, str | None]] = []
        self.lock = threading.Lock()

    def open(self, template: PreparedRun, *, attempts: int, concurrency: int) -> None:
        self.opened.append((attempts, concurrency))

    def close(self) -> None:
        self.closed += 1

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        prepared, store = attempt.prepared, observers.store
        assert store is not None
        if prepared.spec.check_only:  # the payload check before any task
            return RunResult(run_id=attempt.run_id, status="succeeded")
        with self.lock:
            self.attempts.append((attempt.run_id, attempt.number, prepared.spec.batch))
        record = str(store.create_run(attempt.run_id, status="running", batch=prepared.spec.batch))
        if attempt.number == 1 and prepared.task in self.flaky:
            error = RunError("NodeLost", "the node went away")
            result = RunResult(attempt.run_id, "infra_error", error=error, record_dir=record)
        else:
            args = prepared.spec.additional_args or {}
            answer = args["a"] * args["b"] if args["op"] == "mul" else args["a"] + args["b"]
            result = RunResult(attempt.run_id, "succeeded", answer=answer, record_dir=record)
        # Ended in the store as a runner ends its run: one left `running` is an orphan, which
        # the session's next command reaps, saying so on its stderr (the test it serves reads).
        store.update_run(attempt.run_id, status=result.status, ended_at=time.time())
        return result


def test_a_batch_hands_its_attempts_to_an_executor_and_keeps_retries(tmp_path: Path) -> None:
    """The seam for where attempts run: a stand-in executor (no sandbox) gets every attempt
    as plain data with its own run id and number; the batch retries its infrastructure
    faults, scores and records each task once, and opens and closes the executor."""
    rows = math_rows(6)
    tasks = write_jsonl(tmp_path / "tasks.jsonl", rows)
    stand_in = StandInExecutor({rows[1]["task"], rows[4]["task"]})
    spec = BatchSpec(
        tasks=tasks,
        output=tmp_path / "out",
        run=RunSpec(payload=MATH),
        concurrency=2,
        backoff_seconds=0.01,
        backoff_max_seconds=0.01,
    )
    summary = run_batch(spec, executor=stand_in)
    assert summary.counts["succeeded"] == 6 and summary.correct == 6, summary.counts
    assert summary.attempts == 8 and summary.retries == 2
    assert stand_in.opened == [(6, 2)] and stand_in.closed == 1
    results = {r["id"]: r for r in map(json.loads, (tmp_path / "out/results.jsonl").open())}
    assert [results[r["id"]]["attempts"] for r in rows] == [1, 2, 1, 1, 2, 1]
    assert len({run_id for run_id, _, _ in stand_in.attempts}) == 8  # one run id per attempt
    assert sorted(number for _, number, _ in stand_in.attempts) == [1] * 6 + [2] * 2
    assert {batch for _, _, batch in stand_in.attempts} == {summary.batch_id}


class CancellingExecutor(StandInExecutor):
    """The stand-in whose first attempt of each task in `cancel` ends `cancelled`, as an
    attempt does when its session is interrupted."""

    def __init__(self, cancel: set[str]) -> None:
        super().__init__(set())
        self.cancel = cancel

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        if attempt.number == 1 and attempt.prepared.task in self.cancel:
            return RunResult(attempt.run_id, "cancelled", record_dir="")
        return super().run(attempt, observers)


def test_a_resumed_batch_counts_no_cancelled_attempt_as_a_retry(tmp_path: Path) -> None:
    """Attempts cancelled by an interrupted session are run again, not
    retried (before: `retries 3` with no fault); the header's and the summary's concurrency
    agree; another --scorer on resume points to `batch rescore`."""
    rows = math_rows(5)
    tasks = write_jsonl(tmp_path / "tasks.jsonl", rows)
    spec = BatchSpec(
        tasks=tasks, output=tmp_path / "out", run=RunSpec(payload=MATH), concurrency=4, adapt=False
    )
    cut = CancellingExecutor({r["task"] for r in rows[:3]})
    first = run_batch(spec, executor=cut)
    assert first.state == "interrupted" and first.pending == 3
    messages: list[str] = []
    second = run_batch(spec, executor=cut, observers=BatchObservers(on_message=messages.append))
    assert second.state == "complete" and second.counts["succeeded"] == 5
    assert second.attempts == 8 and second.cancelled == 3 and second.retries == 0
    assert any("3 to run at concurrency 3 (fixed)" in m for m in messages), messages
    assert second.session["concurrency"] == 3
    with pytest.raises(ConfigError, match="started with other options") as info:
        run_batch(replace(spec, scorer="contains"), executor=cut)
    assert f"orchestrator batch rescore {tmp_path / 'out'} --scorer contains" in info.value.fix


def test_a_tasks_file_not_found_names_the_one_next_to_it(tmp_path: Path) -> None:
    """The command names the tasks file beside the path typed, as it was typed, and only a
    close one (before: `No tasks file at task.jsonl.`, nothing more, although other handles
    suggest the nearest)."""
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task": "t"}) + "\n")

    def batch(tasks: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", "batch", "research_team", tasks, "-q"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    typo = batch("task.jsonl")
    assert typo.returncode == 2, typo.stderr
    assert "No tasks file at task.jsonl. Did you mean tasks.jsonl?" in typo.stderr, typo.stderr
    assert "fix: Pass tasks.jsonl, or another .jsonl or .csv file of tasks." in typo.stderr
    nested = batch(str(tmp_path / "tasks.csv"))  # another extension, a full path
    assert f"Did you mean {tmp_path / 'tasks.jsonl'}?" in nested.stderr, nested.stderr
    unlike = batch("zzz.jsonl")
    assert unlike.returncode == 2 and "Did you mean" not in unlike.stderr, unlike.stderr
