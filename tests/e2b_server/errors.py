"""The error type shared by the control plane and the template builds."""

from __future__ import annotations

from collections.abc import Mapping


class ApiError(Exception):
    """An error answer of the control-plane API."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
