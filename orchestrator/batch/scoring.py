"""Scoring answers against expected ones, and the statistics of a batch's scores."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError

Scorer = Callable[[Any, Any, dict[str, Any]], "float | None"]


_SPACE = re.compile(r"\s+")


_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")


_NUMBER = re.compile(r"[-+]?(?:\d[\d,_]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def normalize(value: Any) -> str:
    """Text for comparison: case-folded, whitespace collapsed, outer quotes and a trailing
    full stop removed (what a model adds around an answer, not what changes it)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = _SPACE.sub(" ", text.strip().casefold())
    text = text.strip("\"'`").strip()
    text = text[:-1].rstrip() if text.endswith(".") else text
    if _PLAIN_NUMBER.fullmatch(text):  # 42, 42.0 and "42" are the same answer
        number = float(text)
        return str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)
    return text


def to_number(value: Any) -> float | None:
    """A number from an answer: the value itself, else the last number written in the text."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        return None
    text = value.strip()
    try:
        return float(text.replace(",", "").replace("_", ""))
    except ValueError:
        pass
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").replace("_", ""))
    except ValueError:
        return None


def score_exact(answer: Any, expected: Any) -> float:
    return float(normalize(answer) == normalize(expected))


def score_contains(answer: Any, expected: Any) -> float:
    return float(normalize(expected) in normalize(answer))


def score_numeric(answer: Any, expected: Any, tolerance: float) -> float:
    """Equal within `tolerance`, absolute for small numbers and relative for large ones."""
    got, want = to_number(answer), to_number(expected)
    if got is None or want is None or math.isnan(got) or math.isnan(want):
        return 0.0
    return float(abs(got - want) <= tolerance * max(1.0, abs(want)))


BUILTIN_SCORERS = ("exact", "contains", "numeric")

#: The model-graded scorer (`grading.py`, `judge.py`): a judge model grades each answer.
MODEL_SCORER = "model"


def scorer_names(scorer: str | Sequence[str]) -> list[str]:
    """A batch's scorers in order (`--scorer` once or several times), duplicates dropped."""
    names = [scorer] if isinstance(scorer, str) else list(scorer)
    return list(dict.fromkeys(names)) or ["exact"]


def make_scorer(name: str, *, tolerance: float = 1e-6) -> Scorer:
    """A built-in scorer by name, or a user's `module:function` / `path/file.py:function`.

    A user scorer is called as `fn(answer, expected)` or `fn(answer, expected, task)` and
    returns a bool or a number from 0 to 1 (None: not scored). A list as `expected` means
    "any of these" for the built-in scorers.
    """

    def any_of(one: Callable[[Any, Any], float]) -> Scorer:
        def scorer(answer: Any, expected: Any, task: dict[str, Any]) -> float:
            options = expected if isinstance(expected, list) else [expected]
            return max((one(answer, option) for option in options), default=0.0)

        return scorer

    if name == "exact":
        return any_of(score_exact)
    if name == "contains":
        return any_of(score_contains)
    if name == "numeric":
        return any_of(lambda a, e: score_numeric(a, e, tolerance))
    function = load_user_scorer(name)
    try:
        inspect.signature(function).bind(None, None, None)
        takes_task = True
    except (TypeError, ValueError):
        takes_task = False

    def user(answer: Any, expected: Any, task: dict[str, Any]) -> float | None:
        value = function(answer, expected, task) if takes_task else function(answer, expected)
        if value is None:
            return None
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)) and 0 <= value <= 1:
            return float(value)
        raise ValueError(f"the scorer returned {value!r}, not a bool or a number from 0 to 1")

    return user


def load_user_scorer(spec: str) -> Callable[..., Any]:
    module_name, sep, function_name = spec.rpartition(":")
    fix = (
        f"Use one of {', '.join(BUILTIN_SCORERS)}, or module:function / path/to/file.py:function "
        "(the function takes answer, expected[, task] and returns a bool or 0..1)."
    )
    if not sep or not module_name or not function_name.isidentifier():
        raise ConfigError(f"Unknown scorer {spec!r}.", fix)
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            loader = importlib.util.spec_from_file_location(f"_scorer_{file.stem}", file)
            if loader is None or loader.loader is None or not file.is_file():
                raise ImportError(f"no file {file}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` would: scorers next to data
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            f"Cannot load the scorer module {module_name!r} ({type(exc).__name__}: {exc}).", fix
        ) from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(
            f"The scorer module {module_name!r} has no function {function_name}.", fix
        )
    return function


def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval: unlike the normal approximation it stays inside [0, 1] and
    is honest for small batches and accuracies near 0 or 1."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)
