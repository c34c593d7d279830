"""What the state directory knows of each sandbox this path started: one small JSON file per
container (`runsc/sandboxes/<id>.json`: its labels, the runsc process that runs it), written
before runsc starts and removed after everything of it is gone. The engine keeps no labels
for these sandboxes, so these files are what `cleanup`, `tidy` and the kit's checks list
(`list_records`), as the engine's labels are for the Docker path's containers.

Nothing secret is in them: the labels are the run's id, owner, store and version.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ....labels import LABEL_KIND, process_start_time
from ....paths import home_dir

RECORDS_DIR = "runsc/sandboxes"
#: The prefix of every container id this path gives runsc (and no Docker container id has:
#: those are 64 hexadecimal digits), so a sandbox found by `cleanup` goes to the right remover.
ID_PREFIX = "runsc-"


def records_root() -> Path:
    root = home_dir() / RECORDS_DIR
    root.mkdir(parents=True, exist_ok=True)
    return root


def bundle_dir(sandbox_id: str) -> Path:
    """A cold sandbox's own bundle folder (its config.json; the root is the image's)."""
    return records_root() / f"{sandbox_id}.bundle"


def is_ours(sandbox_id: str) -> bool:
    return sandbox_id.startswith(ID_PREFIX)


@dataclass
class SandboxRecord:
    """One sandbox of this path: its container id, labels, and its runsc process (pid and
    start time, so a reused pid is not taken for it), once started."""

    id: str
    labels: dict[str, str]
    pid: int | None = None
    pid_started: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return records_root() / f"{self.id}.json"

    @property
    def kind(self) -> str:
        return self.labels.get(LABEL_KIND, "sandbox")

    def save(self) -> None:
        partial = self.path.with_suffix(".partial")
        data = {"id": self.id, "labels": self.labels, "pid": self.pid}
        partial.write_text(json.dumps({**data, "pid_started": self.pid_started, **self.extra}))
        partial.rename(self.path)

    def started(self, pid: int) -> None:
        self.pid, self.pid_started = pid, process_start_time(pid)
        self.save()

    def running(self) -> bool:
        """Whether its runsc process still runs (the same process: pid and start time)."""
        if self.pid is None:
            return False
        return process_start_time(self.pid) == self.pid_started

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)


def load(sandbox_id: str) -> SandboxRecord | None:
    try:
        data = json.loads((records_root() / f"{sandbox_id}.json").read_text())
    except (OSError, ValueError):
        return None
    known = {"id", "labels", "pid", "pid_started"}
    return SandboxRecord(
        id=str(data["id"]),
        labels=dict(data.get("labels") or {}),
        pid=data.get("pid"),
        pid_started=data.get("pid_started"),
        extra={k: v for k, v in data.items() if k not in known},
    )


def list_records(labels: dict[str, str]) -> list[SandboxRecord]:
    """The records carrying all of `labels`."""
    found = []
    for path in sorted(records_root().glob("*.json")):
        record = load(path.stem)
        if record is not None and all(record.labels.get(k) == v for k, v in labels.items()):
            found.append(record)
    return found


def store_tag() -> str:
    """A short mark of this state directory, in each id it gives: the sandbox cgroups of the
    host (named by id, shared by every store on it) then say which store made them."""
    return hashlib.sha256(str(home_dir()).encode()).hexdigest()[:6]


def new_id(run_id: str) -> str:
    """A container id for a sandbox of `run_id`: ours by its prefix, this store's by its tag
    (`store_tag`), unique (a run's attempts share nothing), in the characters runsc
    accepts."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", run_id)[:80]
    return f"{ID_PREFIX}{store_tag()}-{safe}-{secrets.token_hex(3)}"


def of_this_store(sandbox_id: str) -> bool:
    """Whether `new_id` gave `sandbox_id` in this state directory."""
    return sandbox_id.startswith(f"{ID_PREFIX}{store_tag()}-")
