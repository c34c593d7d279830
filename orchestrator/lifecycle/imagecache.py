"""Images prepared once: one cache for a batch's runs and a pool's sandboxes alike.

A run's image depends on its backend and its extra requirements only, and the inputs behind
them (the image definition, the wheels) cannot change while one batch or one pool lasts: so
runs that share a cache never hash the inputs again, and N of them never race to build.
"""

from __future__ import annotations

import threading

from ..backends.base import Backend, Progress


class ImageCache:
    """The image reference per (backend, requirements), prepared by the first run that needs
    it (the others wait for it). Thread-safe."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, tuple[str, ...]], str] = {}
        self._lock = threading.Lock()

    def prepare(self, backend: Backend, requirements: tuple[str, ...], progress: Progress) -> str:
        """`backend.prepare_image`, once per key; raises what it raises (then nothing is
        kept, and the next run tries again)."""
        key = (backend.name, tuple(requirements))
        with self._lock:
            if key not in self._known:
                self._known[key] = backend.prepare_image(key[1], progress)
            return self._known[key]
