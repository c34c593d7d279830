"""The cap on this process's live E2B sandboxes, one for the whole process.

E2B caps a team's concurrent sandboxes (429 beyond it); `ORCHESTRATOR_E2B_MAX_SANDBOXES` says
how many this process may have alive at once: runs' sandboxes, their gateways' and pooled
(idle) ones alike. Every `E2BBackend` made here with the same account and cap shares one
counter, so that a pool and the cold runs beside it (`schedule serve` makes a backend for
each) stay under it together.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading


class SandboxSlots:
    """A counter of live sandboxes under a cap. A run with a gateway takes two slots at once:
    one taker at a time, so that two such runs never hold one each and wait on each other."""

    def __init__(self, cap: int) -> None:
        self._free = threading.BoundedSemaphore(cap)
        self._taking = threading.Lock()

    def take(self, count: int = 1) -> None:
        """Blocks until `count` slots are free, then holds them."""
        with self._taking:
            for _ in range(count):
                self._free.acquire()

    def release(self) -> None:
        """One slot back (a sandbox is gone); more releases than takes are ignored."""
        with contextlib.suppress(ValueError):
            self._free.release()


_lock = threading.Lock()
_slots: dict[tuple[str, str, int], SandboxSlots] = {}


def sandbox_slots(api_key: str, max_sandboxes: int) -> SandboxSlots:
    """The process's counter for this account (API key and endpoint) and cap: take one
    before a sandbox is created, release it when the sandbox is gone."""
    account = hashlib.sha256(api_key.encode()).hexdigest()
    where = os.environ.get("E2B_API_URL") or os.environ.get("E2B_DOMAIN") or "e2b.app"
    key = (account, where, max_sandboxes)
    with _lock:
        if key not in _slots:
            _slots[key] = SandboxSlots(max_sandboxes)
        return _slots[key]
