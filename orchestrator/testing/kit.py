"""What a conformance check is and what it runs with: `Check` (a promise as data), `Kit` (the
backend under test and its runs, nothing left behind after), `run_check` (a verdict that is
NOT APPLICABLE only where the backend's `Capabilities` declare the capability absent, or
where it lacks the optional part the check needs)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..backends import backend_capabilities, get_backend
from ..backends.base import Backend, Capabilities, ImageStore, SandboxInfo, WarmSandboxes
from ..labels import LABEL_RUN_ID
from ..lifecycle.runner import run
from ..records.store import new_run_id
from ..spec import RunResult, RunSpec
from .probe import action, write_probe

Status = Literal["pass", "fail", "not_applicable"]
#: The time limit of the runs that must be stopped.
SHORT_LIMIT = 5


class CheckFailed(Exception):
    """A promise broken: what was seen, and what to do about it."""

    def __init__(self, detail: str, fix: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fix = fix


class NotApplicable(Exception):
    """The check does not apply here, and why (said in the report, never silent)."""


@dataclass(frozen=True)
class Check:
    """One promise: its name, what it promises, the capability it needs (a `Capabilities`
    field that must be set, `field=value`, or an optional part's name in `PARTS`; None:
    every backend keeps it), and the function that checks it (returns what it saw; raises
    CheckFailed, or NotApplicable saying why)."""

    name: str
    promise: str
    needs: str | None
    function: Callable[[Kit], str]
    #: What to do when it fails, unless the failure says better.
    fix: str = ""


@dataclass(frozen=True)
class CheckOutcome:
    """A check's verdict, for a report line or a pytest outcome."""

    name: str
    status: Status
    promise: str
    detail: str
    fix: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "promise": self.promise,
            "detail": self.detail,
            "fix": self.fix,
            "seconds": round(self.seconds, 2),
        }


#: The optional parts of a backend (`backends.base`) a check may need, by name.
PARTS: dict[str, type] = {"WarmSandboxes": WarmSandboxes, "ImageStore": ImageStore}


def declared(capabilities: Capabilities, needs: str) -> bool:
    """Whether a capability is present: `field` set and not `none`, or `field=value`."""
    name, _, wanted = needs.partition("=")
    value = getattr(capabilities, name)
    if wanted:
        return bool(str(value) == wanted)
    return value not in (False, None, "none", 0)


@dataclass
class Kit:
    """The backend under test and what the checks share: its runs (memoized by what they
    were for, so that checks reading the same run pay for it once), and every run id made,
    so that `close` leaves nothing behind even on a backend that leaves its sandboxes."""

    backend_name: str
    #: The sandbox runtime the runs ask for (None: the machine's and payload's default).
    runtime: str | None = None
    env_file: str | Path | None = None
    backend: Backend = field(init=False)
    capabilities: Capabilities = field(init=False)
    folder: Path = field(init=False)
    run_ids: list[str] = field(default_factory=list)
    events: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _memo: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.capabilities = backend_capabilities(self.backend_name)
        self.backend = get_backend(self.backend_name, env_file=self.env_file)
        self.folder = write_probe(Path(tempfile.mkdtemp(prefix="orchestrator-conformance-")))

    def spec(self, do: str, params: dict[str, Any] | None = None, **options: Any) -> RunSpec:
        """A run of the probe doing `do` on the backend: the mock model and no network unless
        `options` (RunSpec's fields: limits, model, network) say otherwise."""
        fields: dict[str, Any] = {"model": "mock", "network": "none", **options}
        return RunSpec(
            payload=self.folder,
            backend=self.backend_name,
            sandbox_runtime=self.runtime,
            env_file=self.env_file,
            additional_args=action(do, **(params or {})),
            run_id=new_run_id(),
            **fields,
        )

    def run(
        self,
        key: str,
        do: str,
        params: dict[str, Any] | None = None,
        *,
        cancel_at: str | None = None,
        **kw: Any,
    ) -> RunResult:
        """The probe's run for `key` (made once per kit), recorded in the current store;
        `cancel_at`: cancelled (as a caller would) when the first event of that type comes."""
        if key not in self._memo:
            spec = self.spec(do, params, **kw)
            assert spec.run_id is not None
            self.run_ids.append(spec.run_id)
            seen: list[dict[str, Any]] = []
            self.events[spec.run_id] = seen
            cancel = threading.Event()

            def on_event(event: dict[str, Any]) -> None:
                seen.append(event)
                if cancel_at is not None and event.get("type") == cancel_at:
                    cancel.set()

            self._memo[key] = run(spec, on_event=on_event, cancel=cancel, backend=self.backend)
        result: RunResult = self._memo[key]
        return result

    def events_of(self, result: RunResult, kind: str) -> list[dict[str, Any]]:
        """The events of one type a kit's run recorded."""
        return [e for e in self.events.get(result.run_id, []) if e.get("type") == kind]

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def left_of(self, run_id: str) -> list[SandboxInfo]:
        """What the backend still has of a run (sandboxes and what is beside them)."""
        return self.backend.list_sandboxes({LABEL_RUN_ID: run_id})

    def answer(self, result: RunResult) -> Any:
        """The probe's JSON answer of a run that must have succeeded."""
        if result.status != "succeeded":
            raise CheckFailed(
                f"the probe's run {result.run_id} ended {result.status}: "
                f"{result.error.message if result.error else None}"
            )
        try:
            return json.loads(str(result.answer))
        except ValueError as exc:
            raise CheckFailed(f"the probe's answer is not its JSON: {result.answer!r}") from exc

    def close(self) -> None:
        """Remove whatever the kit's runs left (a broken backend's sandboxes too)."""
        for run_id in self.run_ids:
            with contextlib.suppress(Exception):
                self.backend.remove_run(run_id)
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def open_kit(backend: str, **kwargs: Any) -> Iterator[Kit]:
    kit = Kit(backend, **kwargs)
    try:
        yield kit
    finally:
        kit.close()


def run_check(kit: Kit, check: Check) -> CheckOutcome:
    """One check's verdict; a check whose capability the backend lacks is not run."""
    started = time.monotonic()

    def outcome(status: Status, detail: str, fix: str | None = None) -> CheckOutcome:
        took = time.monotonic() - started
        return CheckOutcome(check.name, status, check.promise, detail, fix, took)

    part = PARTS.get(check.needs or "")
    if part is not None and not isinstance(kit.backend, part):
        return outcome(
            "not_applicable", f"needs {check.needs}; the {kit.backend_name} backend has none"
        )
    if part is None and check.needs and not declared(kit.capabilities, check.needs):
        name = check.needs.partition("=")[0]
        value = getattr(kit.capabilities, name)
        return outcome(
            "not_applicable",
            f"needs {check.needs}; the {kit.backend_name} backend declares {name}={value!r}",
        )
    try:
        return outcome("pass", check.function(kit))
    except NotApplicable as exc:
        return outcome("not_applicable", str(exc))
    except CheckFailed as exc:
        return outcome("fail", exc.detail, exc.fix or check.fix or None)
    except Exception as exc:  # a check that cannot run is a failure, said as such
        return outcome("fail", f"the check could not run: {type(exc).__name__}: {exc}", check.fix)
