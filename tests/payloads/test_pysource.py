"""Python source is parsed on the host one thread at a time: CPython 3.11's `ast.parse` is not
safe across threads (a batch's threads parsing payloads at once failed a run with `SystemError:
AST constructor recursion depth mismatch`)."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import pytest

from orchestrator.payloads.agentnames import agent_names
from orchestrator.payloads.manifest import load_manifest
from orchestrator.payloads.program import check_syntax

SOURCE = (
    "from smolagents import CodeAgent\n"
    "agent = CodeAgent(tools=[], model=None, name='helper')\n"
    "def build(model):\n    return agent\n"
)


def test_parses_from_many_threads_never_overlap(monkeypatch, tmp_path: Path) -> None:
    inside = 0
    most = 0
    lock = threading.Lock()
    real_parse = ast.parse

    def watched(*args, **kwargs):
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.005)  # widens the window in which an unguarded parse would overlap
        try:
            return real_parse(*args, **kwargs)
        finally:
            with lock:
                inside -= 1

    monkeypatch.setattr(ast, "parse", watched)
    (tmp_path / "agent.py").write_text(SOURCE)
    (tmp_path / "manifest.toml").write_text('[payload]\nname = "p"\nentrypoint = "agent:build"\n')
    manifest = load_manifest(tmp_path)
    files = {"agent.py": SOURCE}
    errors: list[BaseException] = []

    # The three places the host parses a payload's source, each from three threads.
    readers = [
        lambda: agent_names(files, ()),
        lambda: check_syntax(files, tmp_path),
        manifest.missing_function,
    ]

    def each(i: int) -> None:
        try:
            for _ in range(5):
                readers[i % 3]()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=each, args=(i,)) for i in range(9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert most == 1, f"{most} parses ran at once"


def test_a_syntax_error_still_raises_through_the_lock() -> None:
    from orchestrator.payloads import pysource

    with pytest.raises(SyntaxError):
        pysource.parse("def (:\n", filename="bad.py")
    assert isinstance(pysource.parse("x = 1\n"), ast.Module)
