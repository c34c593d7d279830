"""Errors a user can act on: each says what went wrong and what to do about it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar


class Problem:
    """One problem found in a user's file: where (a field path and, where the format gives
    one, a line), what is wrong, and what to do.

    `field` is the path in the file (`limits.max_steps`, `schedule[2].cron`, a tasks line's
    `memory_mb`); `message` says what is wrong as the file kind names its fields
    ("field `limits.max_steps` = 0 is out of range"); `fix` is what to do (may be empty).
    A plain class (not a dataclass): this module is on the start path of every command.
    """

    __slots__ = ("field", "message", "fix", "line")

    def __init__(self, field: str, message: str, fix: str = "", line: int | None = None) -> None:
        self.field = field
        self.message = message
        self.fix = fix
        self.line = line

    def replace(self, **changes: Any) -> Problem:
        """A copy with some attributes changed (`message`, `field`, `line`, `fix`)."""
        return Problem(**{**self.to_dict(), **changes})

    def describe(self) -> str:
        """One line for a list of problems: `line 12: field ... is .... Use ....`."""
        where = f"line {self.line}: " if self.line else ""
        return where + sentence(self.message) + (f" {self.fix}" if self.fix else "")

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "line": self.line, "message": self.message, "fix": self.fix}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Problem) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Problem({self.field!r}, {self.message!r}, {self.fix!r}, line={self.line})"


_E = TypeVar("_E", bound="OrchestratorError")


class OrchestratorError(Exception):
    """A problem with the user's input or environment, reported as one paragraph.

    `cause` says what is wrong (and where), `fix` says what to do. The CLI prints both and
    exits with `exit_code`; nothing has been started when one of these is raised before a run.
    An error about a file lists every problem found in it (`problems`, see `of_problems`).
    """

    exit_code = 2
    #: The input field the problem is in (`payload`, `model`, `limits`...), when known: set by
    #: `runner.prepare`, so a schedules file or tasks file can point at its own field.
    field: str | None = None
    #: Every problem of the file at fault, each with its field path and line (empty when the
    #: error is not about a file's content).
    problems: tuple[Problem, ...] = ()
    #: The file the `problems` are in.
    source: str = ""

    def __init__(self, cause: str, fix: str = "") -> None:
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause} {fix}".strip())

    @classmethod
    def of_problems(
        cls: type[_E], source: str, problems: Sequence[Problem], fix: str, *, listed: bool = False
    ) -> _E:
        """One error naming every problem of `source` (a file): a single problem as one
        sentence (`source:LINE: message.` and its own fix), several (or any, with `listed`)
        as a list under `source: N problems:`, with `fix` for the whole. Raises nothing."""
        if len(problems) == 1 and not listed:
            (problem,) = problems
            at = f"{source}:{problem.line}" if problem.line else source
            error = cls(f"{at}: {sentence(problem.message)}", problem.fix or fix)
        else:
            count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
            lines = "".join(f"\n  - {p.describe()}" for p in problems)
            error = cls(f"{source}: {count}:{lines}", fix)
        error.problems = tuple(problems)
        error.source = source
        return error

    def problem_lines(self) -> list[str]:
        """Every problem as one line that stands alone (`file:LINE: what. fix`), for a
        report that lists problems (`validate --json`); the whole message if it has none."""
        if not self.problems:
            return [f"{self.cause} {self.fix}".strip()]
        lines = []
        for problem in self.problems:
            at = f"{self.source}:{problem.line}" if problem.line else self.source
            fix = f" {problem.fix}" if problem.fix else ""
            lines.append(f"{at}: {sentence(problem.message)}{fix}")
        return lines


def sentence(text: str) -> str:
    """`text` ending as a sentence: a full stop unless it ends with one, or with `?`."""
    return text if text.endswith((".", "?", "!")) else text + "."


class ManifestError(OrchestratorError):
    """A payload manifest is malformed or asks for something refused."""


class ConfigError(OrchestratorError):
    """A bad option, model spec, policy or missing secret."""


class EngineUnavailable(OrchestratorError):
    """The sandbox engine (Docker daemon, E2B API) cannot be reached."""

    exit_code = 5


class RecordError(OrchestratorError):
    """The run store cannot be written (disk full, read-only, permissions)."""

    exit_code = 5


class ImageBuildError(OrchestratorError):
    """An image could not be built."""

    exit_code = 5


@contextmanager
def at_field(name: str) -> Iterator[None]:
    """Tag an input error raised inside with the field it concerns (a RunSpec field), unless
    it names one already."""
    try:
        yield
    except OrchestratorError as exc:
        exc.field = exc.field or name
        raise
