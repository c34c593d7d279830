"""`batch --scorer model`: a judge model (here the scripted model server, a server of its own)
grades each answer on the host, through a gateway of the batch's own that holds its key;
grades are recorded with the judge's full reply, cached for `batch rescore`, and counted in
the batch's spend. The key is in no sandbox, record, batch file or scorer's environment."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import MISSING, fields
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from orchestrator.batch import BatchSpec, BatchSummary, plan_batch
from orchestrator.batch.budget import BUDGET_EXCEEDED, Spend
from orchestrator.batch.grading import Scoring
from orchestrator.batch.judge import (
    DEFAULT_TEMPLATE,
    JUDGE_FILE,
    Judge,
    JudgeOptions,
    JudgeReply,
    parse_grade,
    render,
)
from orchestrator.errors import ConfigError
from orchestrator.spec import RunSpec, StopRequest
from tests.batch.test_session import MATH, lines_of, math_rows, write_jsonl
from tests.conftest import cli, files_holding
from tests.model_server import ScriptedModelServer

JUDGE = "openai:judge-1"
#: What the scripted judge says when it cannot decide (no grade in it).
UNDECIDED = "I cannot tell whether these agree."


def judging(body: dict[str, Any]) -> str:
    """The scripted judge: compares the expert and submitted answers of the default template,
    and will not decide on 20 (an unparseable grade)."""
    prompt = body["messages"][-1]["content"]
    expert = re.search(r"\[Expert\]: (.*)", prompt)
    submitted = re.search(r"\[Submission\]: (.*)", prompt)
    assert expert and submitted, prompt
    if expert.group(1) == "20":
        return UNDECIDED
    same = expert.group(1).strip() == submitted.group(1).strip()
    return (
        f"Step by step: {submitted.group(1)} vs {expert.group(1)}.\nGRADE: {'C' if same else 'I'}"
    )


@pytest.fixture
def judge_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A sentinel key, in a .env file only (not in this process's environment)."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    key = f"sk-judgetest-{secrets.token_hex(16)}"
    env = tmp_path / "judge.env"
    env.write_text(f"OPENAI_API_KEY={key}\n")
    return key, env


@pytest.fixture
def judge_server() -> Any:
    with ScriptedModelServer([], answer=judging) as server:
        yield server


def options(server: ScriptedModelServer, env: Path, **kw: Any) -> JudgeOptions:
    return JudgeOptions(JUDGE, server.api_base(), env_file=env, **kw)


#: A summary's required fields, any values.
SUMMARY: dict[str, Any] = {
    f.name: None
    for f in fields(BatchSummary)
    if f.default is MISSING and f.default_factory is MISSING
}

# -- the grade, the template ------------------------------------------------------------------


def test_the_last_grade_of_a_reply_counts_and_a_reply_without_one_has_none() -> None:
    assert parse_grade("GRADE: I at first... on reflection GRADE: C") == "C"
    assert parse_grade("grade : **p**") == "P"
    assert parse_grade("The answer is correct.") is None
    assert parse_grade("GRADE: X") is None


def test_the_template_fills_its_fields_and_leaves_other_braces(tmp_path: Path) -> None:
    prompt = render(DEFAULT_TEMPLATE, question="6*7?", expected=[42, "forty-two"], answer=42)
    assert "[Question]: 6*7?" in prompt and "[Submission]: 42" in prompt
    assert "[Expert]: 42 OR forty-two" in prompt and "GRADE: $LETTER" in prompt
    template = tmp_path / "t.txt"
    template.write_text('{"json": 1} Q={question} A={answer}')
    assert (
        render(template.read_text(), question="q", expected=1, answer="a") == '{"json": 1} Q=q A=a'
    )
    template.write_text("no answer field here")
    with pytest.raises(ConfigError, match="no {answer} field"):
        JudgeOptions(JUDGE, "http://127.0.0.1:9/v1", template=template).read_template()


def test_a_judge_must_be_a_chat_completions_model() -> None:
    with pytest.raises(ConfigError, match="OpenAI-compatible"):
        JudgeOptions("mock").spec()
    with pytest.raises(ConfigError, match="--judge"):
        JudgeOptions("nope:x").spec()


# -- the judge's call, on the host, through the gateway ---------------------------------------


def test_the_judge_is_called_through_a_gateway_that_swaps_a_token_for_its_key(
    judge_key: tuple[str, Path], judge_server: ScriptedModelServer
) -> None:
    key, env = judge_key
    judge = Judge(options(judge_server, env))
    reply = judge.ask(render(judge.template, question="q", expected="7", answer="7"))
    assert reply.text.endswith("GRADE: C")
    (request,) = judge_server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == f"Bearer {key}"  # the gateway put it there
    assert request["body"]["model"] == "judge-1" and request["body"]["temperature"] == 0
    # The tokens are the gateway's measure of the server's own figures.
    assert reply.input_tokens == judge_server.usage["input_tokens"] > 0
    assert reply.output_tokens == judge_server.usage["output_tokens"] > 0
    assert not reply.usage_unknown and reply.model == "judge-1"


def test_the_judges_key_may_come_from_a_variable_of_its_own(
    tmp_path: Path, judge_server: ScriptedModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    env = tmp_path / "other.env"
    env.write_text("JUDGE_KEY=sk-judge-own\n")
    chosen = JudgeOptions(JUDGE, judge_server.api_base(), env_file=env, key_env="JUDGE_KEY")
    Judge(chosen).ask(render(DEFAULT_TEMPLATE, question="q", expected=1, answer=1))
    assert judge_server.requests[-1]["headers"]["Authorization"] == "Bearer sk-judge-own"
    with pytest.raises(ConfigError, match="Missing secret JUDGE_KEY"):
        JudgeOptions(
            JUDGE, judge_server.api_base(), env_file=env.with_name("x"), key_env="JUDGE_KEY"
        ).check()


def test_a_reply_that_holds_the_judges_key_is_recorded_masked(
    judge_key: tuple[str, Path],
) -> None:
    key, env = judge_key
    with ScriptedModelServer([f"The header said {key}. GRADE: C"]) as leaky:
        reply = Judge(options(leaky, env)).ask("?")
    assert reply.text == "The header said ***. GRADE: C"


def test_grades_are_cached_an_unparseable_one_is_unscored_and_a_failed_call_is_not_kept(
    tmp_path: Path, judge_key: tuple[str, Path], judge_server: ScriptedModelServer
) -> None:
    _, env = judge_key
    paid: list[int] = []
    scoring = Scoring(
        ["exact", "model"],
        tolerance=1e-6,
        judge=options(judge_server, env),
        folder=tmp_path,
        on_call=lambda reply: paid.append(reply.input_tokens + reply.output_tokens) or None,
    )
    task = {"id": "t1", "task": "3+4?", "expected": 7}
    first = scoring.score(task, "succeeded", 7)
    assert first.score == 1.0 and first.scores == {"exact": 1.0, "model": 1.0}
    assert first.grade is not None and first.grade["grade"] == "C" and not first.grade["cached"]
    assert first.grade["text"].startswith("Step by step")
    again = scoring.score({**task, "id": "t2"}, "succeeded", 7)
    assert again.grade is not None and again.grade["cached"] and again.scores["model"] == 1.0
    assert len(judge_server.requests) == 1 and len(paid) == 1  # asked once, paid once

    undecided = scoring.score({"id": "t3", "task": "4*5?", "expected": 20}, "succeeded", 21)
    assert undecided.scores == {"exact": 0.0, "model": None}
    assert undecided.errors["model"].startswith("the judge's reply has no grade")
    assert undecided.grade is not None and undecided.grade["text"] == UNDECIDED
    assert undecided.fields()["score_errors"] == {"model": undecided.errors["model"]}

    judge_server.fail_next(503)
    failed = scoring.score({"id": "t4", "task": "1+1?", "expected": 2}, "succeeded", 2)
    assert failed.scores["model"] is None and "HTTP 503" in failed.errors["model"]
    kept = [json.loads(line) for line in (tmp_path / JUDGE_FILE).read_text().splitlines()]
    assert [line["id"] for line in kept] == ["t1", "t3"]  # the failed call is asked again
    retried = scoring.score({"id": "t4", "task": "1+1?", "expected": 2}, "succeeded", 2)
    assert retried.scores["model"] == 1.0

    # An agent that did not answer scores 0 and no judge is asked; no expected: unscored.
    calls = len(judge_server.requests)
    assert scoring.score(task, "failed", None).scores == {"exact": 0.0, "model": 0.0}
    assert scoring.score({"id": "x", "task": "?"}, "succeeded", 1).score is None
    assert len(judge_server.requests) == calls


def test_one_scorer_adds_nothing_to_a_result_line_or_the_summary(tmp_path: Path) -> None:
    """A batch with one scorer looks as it always did: `score` (and `score_error`) only."""
    one = Scoring(["exact"], tolerance=1e-6, judge=None, folder=tmp_path)
    assert one.score({"id": "a", "expected": 7}, "succeeded", "7").fields() == {}
    failing = tmp_path / "boom.py"
    failing.write_text("def score(answer, expected):\n    raise RuntimeError('no')\n")
    broken = Scoring([f"{failing}:score"], tolerance=1e-6, judge=None, folder=tmp_path)
    assert broken.score({"id": "a", "expected": 7}, "succeeded", 7).fields() == {
        "score_error": "RuntimeError: no"
    }
    assert "scorers" not in BatchSummary(**SUMMARY).to_dict()
    assert BatchSummary(**SUMMARY, scorers={"exact": {}}).to_dict()["scorers"] == {"exact": {}}


def test_a_model_scorer_needs_a_judge_and_a_judge_needs_the_model_scorer(tmp_path: Path) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(2))
    out = tmp_path / "out"
    proc = cli("batch", str(MATH), str(tasks), "-o", str(out), "--scorer", "model")
    assert proc.returncode == 2 and "--scorer model needs a judge" in proc.stderr
    proc = cli("batch", str(MATH), str(tasks), "-o", str(out), "--judge", JUDGE)
    assert proc.returncode == 2 and "--judge is used only by --scorer model" in proc.stderr
    assert not out.exists()


def test_the_judges_calls_count_against_the_batchs_caps_in_this_session_and_the_next(
    tmp_path: Path, judge_key: tuple[str, Path], judge_server: ScriptedModelServer
) -> None:
    """--max-cost counts each judge call at the judge's --price; the calls recorded in
    judge.jsonl count again when the batch resumes."""
    _, env = judge_key
    spec = BatchSpec(
        tasks=write_jsonl(tmp_path / "tasks.jsonl", math_rows(2)),
        output=tmp_path / "out",
        run=RunSpec(payload=MATH),
        scorer=("exact", "model"),
        judge=options(judge_server, env),
        max_cost="0.0003",
        prices={JUDGE: ("1", "2")},
    )
    plan = plan_batch(spec)
    assert plan.judge_pricing is not None and plan.judge_pricing.source == "--price"
    assert plan.fingerprint["scorer"] == ["exact", "model"]
    assert plan.fingerprint["judge"].startswith(JUDGE)

    def spend_now() -> tuple[Spend, list[str]]:
        reasons: list[str] = []
        made = Spend(spec, plan, [], stop=StopRequest(), on_reached=reasons.append, message=print)
        return made, reasons

    spend, reasons = spend_now()
    reply = JudgeReply("GRADE: C", 100, 50, "judge-1", False)
    assert spend.judged(reply) == Decimal("0.0002") and spend.spent == 150
    assert reasons == []
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / JUDGE_FILE).write_text(
        json.dumps({"key": "k", "tokens": {"input": 100, "output": 50}, "cost_usd": "0.0002"})
        + "\n"
    )
    again, reasons = spend_now()  # the next session starts from what the judge spent
    assert again.spent == 150 and again.cost == Decimal("0.0002")
    again.judged(reply)
    assert reasons == [BUDGET_EXCEEDED] and again.cost == Decimal("0.0004")


# -- a whole batch ----------------------------------------------------------------------------

PROBE = '''\
import json, os
from pathlib import Path


def env(answer, expected):
    """Records the environment the scorers run in; scores nothing."""
    Path(__file__).with_name("scorer-env.json").write_text(json.dumps(dict(os.environ)))
    return None
'''


@pytest.mark.docker
def test_a_batch_graded_by_a_judge_keeps_its_key_out_and_counts_its_tokens(
    tmp_path: Path,
    agent_image: str,
    judge_key: tuple[str, Path],
    judge_server: ScriptedModelServer,
) -> None:
    key, env = judge_key
    # q000: 6 (right); q001: expected 8, the agent says 7 (wrong); q002: expected 20, the judge
    # cannot decide (unscored, with its reason).
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(3, wrong=(1,)))
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    judge = ["--judge", JUDGE, "--judge-api-base", judge_server.api_base(), "--env-file", str(env)]
    scorers = ["--scorer", "exact", "--scorer", "model", "--scorer", f"{probe}:env"]
    price = ["--max-cost", "1", "--price", f"{JUDGE}=1/2"]
    done = cli("batch", str(MATH), str(tasks), "-o", str(out), *scorers, *judge, *price, "-q")
    assert done.returncode == 0, done.stderr

    rows = {row["id"]: row for row in lines_of(out / "results.jsonl")}
    assert rows["q000"]["scores"] == {"exact": 1.0, "model": 1.0, f"{probe}:env": None}
    assert rows["q000"]["score"] == 1.0 and rows["q000"]["grade"]["grade"] == "C"
    assert rows["q000"]["grade"]["text"] == "Step by step: 6 vs 6.\nGRADE: C"
    assert rows["q000"]["grade"]["judge"].startswith(JUDGE)
    assert rows["q001"]["scores"]["model"] == 0.0 and rows["q001"]["grade"]["grade"] == "I"
    assert rows["q002"]["scores"]["exact"] == 1.0 and rows["q002"]["scores"]["model"] is None
    assert rows["q002"]["grade"]["text"] == UNDECIDED
    assert "no grade" in rows["q002"]["grade"]["reason"]
    assert "no grade" in rows["q002"]["score_errors"]["model"]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["scorer"] == "exact" and summary["accuracy"] == 2 / 3
    assert summary["scorers"]["model"]["scored"] == 2
    assert summary["scorers"]["model"]["accuracy"] == 0.5
    spend = summary["spend"]
    judged = judge_server.usage["input_tokens"] + judge_server.usage["output_tokens"]
    assert spend["judge"] == {
        "calls": 3,
        "tokens": judged,
        "cost_usd": float(
            (judge_server.usage["input_tokens"] + 2 * judge_server.usage["output_tokens"])
            / Decimal(1_000_000)
        ),
    }
    assert spend["tokens"] >= judged and spend["cost_usd"] == spend["judge"]["cost_usd"]

    # The key reached the judge's server, and nothing else.
    assert {r["headers"]["Authorization"] for r in judge_server.requests} == {f"Bearer {key}"}
    records = [Path(row["record_dir"]) for row in rows.values()]
    for record in records:
        events = [json.loads(line) for line in (record / "events.jsonl").open()]
        (created,) = [e for e in events if e["type"] == "sandbox_created"]
        assert "OPENAI_API_KEY" not in created["secrets_inside"]
    assert files_holding(key, tmp_path) == [str(env)]  # the scan finds what is there
    assert files_holding(key, out, *records) == []
    scorer_env = tmp_path / "scorer-env.json"
    assert scorer_env.is_file() and key not in scorer_env.read_text()
    assert "OPENAI_API_KEY" not in json.loads(scorer_env.read_text())

    # A rescore with the same judge and template pays nothing; another template asks again.
    calls = len(judge_server.requests)
    again = cli("batch", "rescore", str(out), "--scorer", "model", *judge, "--json")
    assert again.returncode == 0, again.stderr
    assert len(judge_server.requests) == calls
    rescored = json.loads((out / "summary.rescore-model.json").read_text())
    assert rescored["judge"]["calls"] == 0 and rescored["judge"]["cached"] == 3
    assert rescored["scored"] == 2 and rescored["accuracy"] == 0.5
    template = tmp_path / "strict.txt"
    template.write_text("[Expert]: {expected}\n[Submission]: {answer}\n")
    other = cli(
        "batch", "rescore", str(out), "--scorer", "model", *judge, "--judge-template", str(template)
    )
    assert other.returncode == 0, other.stderr
    assert len(judge_server.requests) == calls + 3
    assert files_holding(key, out) == []
