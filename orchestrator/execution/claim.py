"""A warm sandbox handed to one run (`Claim`), and sandboxes removed in the background.

A pool hands out a claim; the run uses its sandbox (`runner.execute(..., warm_sandbox=claim)`) and
removes it; `Claim.release` then removes its helpers (network, proxy, gateway) without
holding up the run's result. `wait_removals` waits for every removal started here (a pool's
close does, so that nothing of it is left when it returns).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from ..backends.base import Sandbox
from ..lifecycle.runner import WarmSandbox


@dataclass(frozen=True)
class Claim(WarmSandbox):
    """A warm sandbox taken from the pool, for the run `run_id` only (`Pool.execute_claimed`,
    or `runner.execute(..., warm_sandbox=claim)` then `release`)."""

    _released: threading.Event = field(default_factory=threading.Event, compare=False)

    def release(self) -> None:
        """Remove the sandbox and its helpers (network, proxy, gateway) in the background,
        once (idempotent): the run that used it has ended and removed the sandbox itself, and
        its helpers need not hold up its result. `Pool.close` waits for the removal; if this
        process dies first, their keepers and `cleanup` see to it."""
        if not self._released.is_set():
            self._released.set()
            remove_later(self.sandbox)


_removals: list[threading.Thread] = []
_removals_lock = threading.Lock()


def remove_later(sandbox: Sandbox) -> None:
    """Remove a sandbox without holding up the caller (a pool's lock may be held); errors
    are ignored (its keeper and `cleanup` remain). `wait_removals` waits for it."""

    def remove() -> None:
        with contextlib.suppress(Exception):
            sandbox.remove()

    thread = threading.Thread(target=remove, name="pool-remove", daemon=True)
    with _removals_lock:
        _removals[:] = [t for t in _removals if t.is_alive()]
        _removals.append(thread)
    thread.start()


def wait_removals(timeout: float = 60.0) -> None:
    """Until every removal `remove_later` started has ended (each waited for `timeout` s)."""
    with _removals_lock:
        pending = list(_removals)
    for thread in pending:
        thread.join(timeout=timeout)
