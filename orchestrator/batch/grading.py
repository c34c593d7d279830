"""A batch's scorers together (`--scorer exact --scorer model`): each answer is scored by each,
in order. The first is the batch's score (its accuracy, a task's verdict, `score` in its
result line, exactly as with one scorer); with several, `scores` holds every one by name.
The `model` scorer asks the judge (`judge.py`) through the grade cache, and its result line
gets `grade`: the judge, its full reply, the letter parsed and why there is none."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..images.imagedef import Progress
from .judge import (
    GRADES,
    GradeCache,
    Judge,
    JudgeError,
    JudgeOptions,
    JudgeReply,
    call_line,
    parse_grade,
    render,
)
from .output import FINISHED
from .scoring import MODEL_SCORER, Scorer, make_scorer

#: Counts a judge call in the batch's spend and returns its cost (None: no --max-cost).
OnJudgeCall = Callable[[JudgeReply], "Decimal | None"]


@dataclass
class Scored:
    """An answer's scores: the first scorer's (`score`, and `error`: why it gave none), every
    scorer's by name, and the model scorer's grade record (None: no model scorer or no
    call made: an agent failure scores 0 without asking)."""

    score: float | None
    error: str | None
    scores: dict[str, float | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    grade: dict[str, Any] | None = None

    def fields(self) -> dict[str, Any]:
        """What a result line holds beyond `score` (nothing more for one built-in scorer)."""
        extra: dict[str, Any] = {}
        if self.error:
            extra["score_error"] = self.error
        if len(self.scores) > 1:
            extra["scores"] = self.scores
            first = next(iter(self.scores))
            others = {k: v for k, v in self.errors.items() if k != first}
            if others:
                extra["score_errors"] = others
        if self.grade is not None:
            extra["grade"] = self.grade
        return extra


class Scoring:
    """The batch's scorers, ready (ConfigError, exit 2: an unknown scorer, `model` without
    --judge, a judge that cannot be asked). `folder`: the batch folder (its grade cache);
    `on_call`: counts each judge call in the batch's spend; `by`: who asks (`batch`,
    `rescore`), for the cache's lines."""

    def __init__(
        self,
        names: list[str],
        *,
        tolerance: float,
        judge: JudgeOptions | None,
        folder: str | Path,
        on_call: OnJudgeCall | None = None,
        by: str = "batch",
    ) -> None:
        self.names = names
        self.scorers: dict[str, Scorer] = {
            n: make_scorer(n, tolerance=tolerance) for n in names if n != MODEL_SCORER
        }
        self.judge: Judge | None = None
        self.cache: GradeCache | None = None
        if MODEL_SCORER in names:
            if judge is None:
                raise ConfigError(
                    "--scorer model needs a judge.", "Give --judge provider:id (as --model)."
                )
            self.judge, self.cache = Judge(judge), GradeCache(folder)
        self.on_call = on_call
        self.by = by
        self._lock = threading.Lock()
        #: A lock per grade being asked for.
        self._asking: dict[str, threading.Lock] = {}
        #: Said when the grade cache cannot be written (the grade itself is kept).
        self.message: Progress = lambda _text: None

    def score(self, task: dict[str, Any], status: str, answer: Any) -> Scored:
        """`task`: its id, text and expected answer (a tasks-file row). None without an
        expected answer or when the infrastructure failed; 0 for an agent that did not
        answer (no judge is asked); else each scorer's, a failure unscored with its reason."""
        expected = task.get("expected")
        if expected is None or status not in FINISHED:
            return self._all(None)
        if status != "succeeded":
            return self._all(0.0)
        scores: dict[str, float | None] = {}
        errors: dict[str, str] = {}
        grade = None
        for name in self.names:
            try:
                if name == MODEL_SCORER:
                    scores[name], why, grade = self.grade(task, answer)
                    if why:
                        errors[name] = why
                else:
                    scores[name] = self.scorers[name](answer, expected, task)
            except Exception as exc:  # one bad answer must not sink the others
                scores[name] = None
                errors[name] = f"{type(exc).__name__}: {exc}"
        first = self.names[0]
        return Scored(scores[first], errors.get(first), scores, errors, grade)

    def _all(self, value: float | None) -> Scored:
        return Scored(value, None, dict.fromkeys(self.names, value))

    def grade(self, task: dict[str, Any], answer: Any) -> tuple[float | None, str | None, Any]:
        """The judge's score, why there is none, and the grade record: from the cache when
        the same answer, expected answer, template and judge were graded before."""
        assert self.judge is not None
        key = self.judge.key_for(answer, task.get("expected"))
        with self._lock:  # the same answer graded by two workers at once is paid once
            asking = self._asking.setdefault(key, threading.Lock())
        with asking:
            return self._grade(task, answer, key)

    def _grade(self, task: dict[str, Any], answer: Any, key: str) -> tuple[Any, Any, Any]:
        assert self.judge is not None and self.cache is not None
        judge, expected = self.judge, task.get("expected")
        line = self.cache.get(key)
        cached = line is not None
        if line is None:
            question = task.get("task")
            prompt = render(judge.template, question=question, expected=expected, answer=answer)
            try:
                reply = judge.ask(prompt)
            except JudgeError as exc:
                record = {"judge": judge.describe, "grade": None, "score": None, "text": None}
                return None, str(exc), {**record, "reason": str(exc), "cached": False}
            cost = self.on_call(reply) if self.on_call is not None else None
            letter = parse_grade(reply.text)
            line = call_line(key, str(task.get("id")), judge, reply, cost, self.by)
            line.update(
                grade=letter,
                score=GRADES.get(letter) if letter else None,
                reason=None
                if letter
                else "the judge's reply has no grade (no 'GRADE: C', 'GRADE: P' or 'GRADE: I')",
            )
            try:
                self.cache.add(line)
            except OSError as exc:
                self.message(f"warning: cannot write {self.cache.path}: {exc}")
        record = {k: line.get(k) for k in ("judge", "grade", "score", "text", "reason")}
        return line.get("score"), line.get("reason"), {**record, "cached": cached}
