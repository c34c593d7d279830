"""One home for how a run ended: `supervise` returns a typed `Outcome`, only
lifecycle/outcome.py writes a result's status, and a run's error is read as a `RunError`
(attributes), a dict only inside its own `to_dict`/`from_dict`. Each scan is also run on a
planted violation, so that it is seen to fail."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from orchestrator.backends.base import ExitInfo
from orchestrator.lifecycle import supervise
from orchestrator.lifecycle.outcome import Outcome, OutcomeKind, decide_status
from orchestrator.spec import RunError, RunResult
from tests.conftest import REPO

#: The one module that decides how a run ended and writes it into the result.
HOME = Path("orchestrator/lifecycle/outcome.py")
#: Where a run error may be read as a dict: its own edge with JSON.
DICT_EDGE = {"to_dict", "from_dict"}


def package_files() -> list[Path]:
    return sorted(p.relative_to(REPO) for p in (REPO / "orchestrator").rglob("*.py"))


def status_writes(source: str) -> list[str]:
    """Where `source` writes a run's status: `x.status = ...` (also in a tuple target, or
    augmented), `setattr(x, "status", ...)`, `RunResult(...)` given a status (keyword or
    its second positional argument) and `replace(x, status=...)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            for element in elements:
                if isinstance(element, ast.Attribute) and element.attr == "status":
                    found.append(f"line {node.lineno}: {ast.unparse(element)} = ...")
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func).rsplit(".", 1)[-1]
        keywords = {k.arg for k in node.keywords}
        if name == "setattr" and len(node.args) > 1:
            key = node.args[1]
            if isinstance(key, ast.Constant) and key.value == "status":
                found.append(f"line {node.lineno}: setattr(..., 'status', ...)")
        elif name == "RunResult" and ("status" in keywords or len(node.args) > 1):
            found.append(f"line {node.lineno}: RunResult(..., status=...)")
        elif name == "replace" and "status" in keywords:
            found.append(f"line {node.lineno}: replace(..., status=...)")
    return found


def _is_an_error(node: ast.AST, aliases: set[str]) -> bool:
    """Whether `node` evaluates to a run's error: an `.error` attribute (a result's, a stop
    request's), a name bound to one in the same function, or either with a fallback
    (`x.error or {}`, `x.error if ... else {}`)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "error"
    if isinstance(node, ast.Name):
        return node.id in aliases
    if isinstance(node, ast.BoolOp):
        return any(_is_an_error(v, aliases) for v in node.values)
    if isinstance(node, ast.IfExp):
        return _is_an_error(node.body, aliases) or _is_an_error(node.orelse, aliases)
    return False


def error_dict_reads(source: str) -> list[str]:
    """Where `source` reads a run's error as a dict (`error.get(...)`, `error["..."]`) outside
    a `to_dict`/`from_dict`: on `x.error`, `(x.error or {})`, or a name bound from one."""
    found = []
    tree = ast.parse(source)
    scopes: list[ast.AST] = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    for scope in scopes:
        if getattr(scope, "name", None) in DICT_EDGE:
            continue
        body = [n for n in ast.walk(scope) if n is not scope]
        inner = {
            id(m)
            for n in body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            for m in ast.walk(n)
        }
        own = [n for n in body if id(n) not in inner]  # nested functions are their own scope
        aliases: set[str] = set()
        for node in own:
            if isinstance(node, ast.Assign) and _is_an_error(node.value, set()):
                aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in own:
            read = None
            if isinstance(node, ast.Subscript) and _is_an_error(node.value, aliases):
                read = node.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and _is_an_error(node.func.value, aliases)
            ):
                read = node.func.value
            if read is not None:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_supervise_returns_a_typed_outcome() -> None:
    """Its annotation, as written and as resolved: how a run stopped is a value of a closed
    set of kinds, not a bare string with its reason on the side."""
    tree = ast.parse((REPO / "orchestrator/lifecycle/supervise.py").read_text())
    (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "supervise"]
    assert function.returns is not None and ast.unparse(function.returns) == "Outcome"
    assert typing.get_type_hints(supervise.supervise)["return"] is Outcome
    assert typing.get_origin(OutcomeKind) is typing.Literal
    assert not hasattr(supervise.RunRecorder, "stop_reason")  # no side channel on the record


@pytest.mark.parametrize("kind", typing.get_args(OutcomeKind))
def test_every_kind_of_outcome_is_decided(kind: OutcomeKind) -> None:
    """Each kind `supervise` can return maps to a status; only `finished` lets the sandbox's
    claim of success count."""
    status, error = decide_status(Outcome(kind, "why"), ExitInfo(exit_code=0), {"state": "success"})
    assert (status == "succeeded") == (kind == "finished")
    assert (error is None) == (kind == "finished")
    assert error is None or isinstance(error, RunError)


def test_only_the_outcomes_home_writes_a_runs_status() -> None:
    assert (REPO / HOME).is_file()
    found = {
        str(path): writes
        for path in package_files()
        if path != HOME and (writes := status_writes((REPO / path).read_text()))
    }
    assert not found, f"a run's status is decided in {HOME} only: {found}"
    assert status_writes((REPO / HOME).read_text())  # the home does write it: the scan sees


def test_the_status_scan_sees_each_way_of_writing_one() -> None:
    planted = """
def elsewhere(result, other):
    result.status = "failed"
    other.answer, result.status = 1, "failed"
    result.status += ""
    setattr(result, "status", "failed")
    RunResult(run_id="r", status="failed")
    RunResult("r", "failed")
    replace(result, status="failed")
"""
    assert len(status_writes(planted)) == 7
    assert (
        status_writes("result.status == 'failed'\nRunResult(**data)\nreplace(p, run_id=1)\n") == []
    )


def test_no_run_error_is_read_as_a_dict() -> None:
    found = {
        str(path): reads
        for path in package_files()
        if (reads := error_dict_reads((REPO / path).read_text()))
    }
    assert not found, f"read a run's error by its attributes (RunError): {found}"


def test_the_error_scan_sees_each_way_of_reading_one_as_a_dict() -> None:
    planted = """
def elsewhere(result, cancel):
    result.error.get("type")
    result.error["message"]
    (result.error or {}).get("message")
    cancel.error.get("message")
    error = result.error or {}
    error.get("kind")
    error["problems"]
    (result.error if result else {}).get("type")
"""
    assert len(error_dict_reads(planted)) == 7
    allowed = """
class RunError:
    def to_dict(self):
        return self.error["type"]

def elsewhere(event, result):
    error = event.get("error")
    error.get("type")  # an event's error, from the sandbox's own event
    result.error.message[:10]
    line = {"error": result.error.to_dict()}
    line["error"]
"""
    assert error_dict_reads(allowed) == []


def test_a_result_keeps_its_json_and_reads_old_records() -> None:
    """A typed error inside, the same dict outside: `to_dict` writes what result.json always
    held, and a record written before (a sandbox's error with keys of its own) reads back to
    the same JSON."""
    result = RunResult(run_id="r", status="failed", error=RunError("timed_out", "time limit"))
    assert result.to_dict()["error"] == {"type": "timed_out", "message": "time limit"}
    payload = RunError.payload("bad requirement", "python.requirements").to_dict()
    assert list(payload) == ["type", "message", "problems", "field"]
    old = {
        "run_id": "r-old",
        "status": "failed",
        "error": {"type": "SystemExit", "message": "3", "kind": "program", "exit_code": 3},
        "some_field_of_a_newer_writer": 1,
    }
    loaded = RunResult.from_dict(old)
    assert loaded.error is not None and loaded.error.kind == "program"
    assert loaded.error.extra == {"exit_code": 3}
    assert loaded.to_dict()["error"] == old["error"]
    assert list(loaded.to_dict()["error"]) == list(old["error"])
    sandbox_payload = {"type": "PayloadError", "message": "x", "kind": "payload", "problems": ["x"]}
    assert RunError.from_dict(sandbox_payload).to_dict() == sandbox_payload  # no `field` added
    assert RunError.from_dict("not a dict").to_dict() == {"type": "error", "message": "not a dict"}
