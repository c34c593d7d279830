"""Time, injected: the scheduler asks a `Clock`, so tests simulate hours in milliseconds."""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Protocol


class Clock(Protocol):
    """Time as the scheduler sees it; tests inject one that jumps instead of sleeping."""

    def now(self) -> datetime:
        """The current instant, timezone-aware."""
        ...

    def sleep(self, seconds: float, stop: threading.Event) -> bool:
        """Wait up to `seconds`; return True when `stop` is set (then return at once)."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    def sleep(self, seconds: float, stop: threading.Event) -> bool:
        return stop.wait(max(0.0, seconds))
