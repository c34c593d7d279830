"""The cap on this process's live E2B sandboxes, one for the whole process.

E2B caps a team's concurrent sandboxes (429 beyond it); `ORCHESTRATOR_E2B_MAX_SANDBOXES` says
how many this process may have alive at once: runs' sandboxes and pooled (idle) ones alike.
Every `E2BBackend` made here with the same account and cap shares one counter, so that a
pool and the cold runs beside it (`schedule serve` makes a backend for each) stay under it
together.
"""

from __future__ import annotations

import hashlib
import os
import threading

_lock = threading.Lock()
_slots: dict[tuple[str, str, int], threading.BoundedSemaphore] = {}


def sandbox_slots(api_key: str, max_sandboxes: int) -> threading.BoundedSemaphore:
    """The process's counter for this account (API key and endpoint) and cap: acquire one
    before a sandbox is created, release it when the sandbox is gone."""
    account = hashlib.sha256(api_key.encode()).hexdigest()
    where = os.environ.get("E2B_API_URL") or os.environ.get("E2B_DOMAIN") or "e2b.app"
    key = (account, where, max_sandboxes)
    with _lock:
        if key not in _slots:
            _slots[key] = threading.BoundedSemaphore(max_sandboxes)
        return _slots[key]
