"""A run's sandbox restored while `orchestrator run` is still starting: its head start.

A cold `orchestrator run` spends about 0.2 s importing its modules and checking the payload
before it asks for its sandbox, and runsc-direct's restore then takes about 0.4 s more
(benchmarks/results/code_figures.md#a-head-start-for-the-restore). Where the last run of
the same payload was restored by this path, `begin` starts restoring that run's snapshot at
once, at the command's very start, so the two overlap; the run's own restore call
(`direct.restore`) takes it (`take`) when its snapshot is that one, with the same limits,
and otherwise restores its own.

What runs before the run's checks is only this: a sandbox restored from a snapshot, which
holds no request, task, token or secret (snapshot.py), without network, in a cgroup of its
own, its keeper stopping it unless a request comes within RESTORABLE_IDLE. It gets a request
only from the run that took it, after every check. Not taken by the end of the command
(input refused, another shape, the payload's network), `finish` removes it before the
process ends; an orchestrator killed meanwhile leaves it to its keeper and to `cleanup` (its
record names this process as its owner).

The hint of what to restore is one small file per payload folder in the state directory
(`runsc/head_starts/`, at most HINTS_KEPT), written by `finish` after a run this path
restored, and removed after a head start the run did not take. Its contents are checked
against the snapshot store before use, and a wrong hint costs only a restore that is thrown
away. `$ORCHESTRATOR_HEAD_START=off` turns head starts off (a run then restores once its
checks are done, as a library call's does); `$ORCHESTRATOR_SNAPSHOTS=off` turns them off with
the snapshots.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator_runtime.protocol import RESTORED_ACK_LINE

from ....labels import LABEL_KIND, run_labels
from ....paths import home_dir
from ....spec import Limits
from ..runtimes import RUNSC_DIRECT
from ..snapshot_store import enabled, switched_on
from .binary import runsc, spawn
from .bundle import images_root
from .cgroup import Cgroup, boot_cpus
from .records import SandboxRecord, new_id
from .snapshot import META_FILE, SNAPSHOTS_DIR, Snapshot

#: `ORCHESTRATOR_HEAD_START=off` (or 0, no, false): no head starts.
HEAD_START_ENV = "ORCHESTRATOR_HEAD_START"
#: Where the hints are kept, under the state directory.
HINTS_DIR = "runsc/head_starts"
#: How many hints are kept (one per payload folder; the least recently used go first).
HINTS_KEPT = 64
#: The run id in a head start's labels until a run takes it.
UNTAKEN = "head-start"


@dataclass
class Begun:
    """A head start: the snapshot it restores and the sandbox restoring it."""

    key: str
    folder: Path
    limits: Limits
    record: SandboxRecord
    cgroup: Cgroup
    proc: subprocess.Popen[bytes]


@dataclass
class Session:
    """This command's head start, if one was begun, and what its run restored (the next
    hint): `begin` opens it, `take` fills it, `finish` closes it."""

    hint: Path
    begun: Begun | None = None
    taken: bool = False
    restored: dict[str, Any] | None = None


#: The command's session (None outside an `orchestrator run` process, in a batch, a pool, a
#: library call: nothing is begun there, and `take` finds nothing).
_session: Session | None = None


def hint_path(payload: str) -> Path:
    """The hint file of the payload at `payload` (a path, as typed)."""
    digest = hashlib.sha256(os.path.abspath(payload).encode()).hexdigest()[:16]
    return home_dir() / HINTS_DIR / f"{digest}.json"


#: The choices of `run` under which its sandbox may be this path's restore: each option
#: (its environment variable, read when the option is not given) and the values that allow
#: it. Other places that choose (the config file, the payload's manifest) are not read this
#: early: a head start they rule out is thrown away once, and its hint with it.
MAY_RESTORE: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "--backend": ("ORCHESTRATOR_BACKEND", ("docker",)),
    # "auto" is backends/base.py's AUTO_RUNTIME, whose module is not loaded this early
    "--sandbox-runtime": ("ORCHESTRATOR_SANDBOX_RUNTIME", ("auto", RUNSC_DIRECT)),
    "--network": (None, ("none",)),
}


def payload_of(words: list[str]) -> str | None:
    """The payload folder of `orchestrator run WORDS...` (its first word that is no option
    and names an existing path), or None: no `run`, help asked for, no payload, or an
    option that rules this path's restore out (MAY_RESTORE)."""
    if not words or words[0] != "run" or "-h" in words or "--help" in words:
        return None
    for option, (variable, allowed) in MAY_RESTORE.items():
        given = option_value(words, option) or (os.environ.get(variable) if variable else None)
        value = given or allowed[0]
        if value not in allowed:
            return None
    for word in words[1:]:
        if not word.startswith("-") and os.path.exists(word):
            return word
    return None


def option_value(words: list[str], option: str) -> str | None:
    """The value `words` give `option` last (`--option VALUE` or `--option=VALUE`)."""
    found = None
    for at, word in enumerate(words):
        if word == option and at + 1 < len(words):
            found = words[at + 1]
        elif word.startswith(f"{option}="):
            found = word.split("=", 1)[1]
    return found


def begin(words: list[str]) -> None:
    """For `orchestrator run WORDS...`, start restoring the snapshot its payload's last run
    restored, when there is a hint and the snapshot is still there. Never fails the
    command: whatever goes wrong here only means no head start (KeyboardInterrupt aside,
    with nothing of it left)."""
    global _session
    payload = payload_of(words)
    if payload is None or not enabled() or not switched_on(HEAD_START_ENV):
        return
    _session = Session(hint_path(payload))
    try:
        hint = json.loads(_session.hint.read_text())
    except (OSError, ValueError):
        return  # none yet (or half-written): the run writes it
    try:
        _session.begun = _restore(*_checked(hint))
    except (ValueError, KeyError, TypeError):  # its snapshot is gone, or it is malformed
        _session.hint.unlink(missing_ok=True)
    except OSError:  # runsc or the cgroup refused: the run's own restore says why
        return


def _checked(hint: Any) -> tuple[Snapshot, Limits]:
    """A hint's snapshot, when it is a complete one of this state directory's
    (`runsc/images/<image>/snapshots/<key>`), and its limits. Raises ValueError otherwise
    (TypeError, KeyError for a malformed hint)."""
    ready = Snapshot(str(hint["key"]), Path(hint["folder"]))
    exported = ready.folder.parent.parent
    if (
        ready.folder.name != ready.key
        or ready.folder.parent.name != SNAPSHOTS_DIR
        or exported.parent != images_root()
        or ".." in ready.folder.parts
    ):
        raise ValueError(f"{ready.folder} is not a snapshot of this state directory")
    if not (ready.folder / META_FILE).is_file() or not ready.checkpoint.is_dir():
        raise ValueError(f"snapshot {ready.key} is gone or incomplete")
    figures = hint["limits"]
    limits = Limits(
        memory_mb=int(figures["memory_mb"]), cpus=float(figures["cpus"]), pids=int(figures["pids"])
    )
    return ready, limits


def _restore(ready: Snapshot, limits: Limits) -> Begun:
    """A new sandbox restored from `ready`, in its own cgroup, told it was restored (as
    `direct.restore`'s). Everything of it is removed again when this fails."""
    record = SandboxRecord(new_id(UNTAKEN), {**run_labels(UNTAKEN), LABEL_KIND: "sandbox"})
    cgroup = Cgroup.of(record.id)
    proc = None
    try:
        os.utime(ready.folder / META_FILE)  # in use: no eviction takes it meanwhile
        record.save()
        cgroup.make(limits, boot_cpus(limits))
        argv = runsc("restore", f"--image-path={ready.checkpoint}", f"--bundle={ready.folder}")
        proc = spawn(cgroup.joined([*argv, record.id]))
        record.started(proc.pid)
        assert proc.stdin is not None
        proc.stdin.write(RESTORED_ACK_LINE.encode())
        proc.stdin.flush()
    except BaseException:
        _remove(record, cgroup, proc)
        raise
    return Begun(ready.key, ready.folder, limits, record, cgroup, proc)


def take(
    key: str, folder: Path, limits: Limits, labels: dict[str, str]
) -> tuple[SandboxRecord, Cgroup, subprocess.Popen[bytes]] | None:
    """The head start, for a run about to restore snapshot `key` at `folder` with `limits`:
    its record (now labelled `labels`, the run's), cgroup and runsc process, when it
    restores that snapshot with those limits and is still running; else None (the run
    restores its own; an unfit head start is removed by `finish`). Notes the snapshot as
    the payload's next hint either way."""
    session = _session
    if session is None:
        return None
    session.restored = {"key": key, "folder": str(folder), "limits": _figures(limits)}
    begun = session.begun
    if begun is None or session.taken:
        return None
    fits = (begun.key, begun.folder, _figures(begun.limits)) == (key, folder, _figures(limits))
    if not fits or begun.proc.poll() is not None:
        return None
    session.taken = True
    begun.record.labels = {**labels, LABEL_KIND: "sandbox"}
    begun.record.save()
    return begun.record, begun.cgroup, begun.proc


def finish() -> None:
    """The command's end: the payload's hint written (what its run restored) or removed (a
    head start its run did not take), and an untaken head start removed. Never raises."""
    global _session
    session, _session = _session, None
    if session is None:
        return
    begun = None if session.taken else session.begun
    with contextlib.suppress(OSError):
        if session.restored is not None:
            _write_hint(session.hint, session.restored)
        elif begun is not None:
            session.hint.unlink(missing_ok=True)
    if begun is not None:
        _remove(begun.record, begun.cgroup, begun.proc)


def _write_hint(path: Path, hint: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(hint))
    partial.rename(path)
    hints = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in hints[HINTS_KEPT:]:
        old.unlink(missing_ok=True)


def _figures(limits: Limits) -> dict[str, Any]:
    """What of a run's limits its sandbox's cgroup is made of (`Cgroup.make`)."""
    return {"memory_mb": limits.memory_mb, "cpus": limits.cpus, "pids": limits.pids}


def _remove(record: SandboxRecord, cgroup: Cgroup, proc: subprocess.Popen[bytes] | None) -> None:
    """Everything of a head start (sandbox.py's removal, imported only when one is thrown
    away)."""
    from .sandbox import RunscSandbox

    sandbox = RunscSandbox(record, cgroup)
    sandbox.proc = proc
    with contextlib.suppress(Exception):
        sandbox.remove()
