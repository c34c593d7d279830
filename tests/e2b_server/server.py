"""`E2BTestServer`: the fake E2B cloud served over HTTP by uvicorn in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

from .app import E2BApp
from .cloud import FakeE2BCloud


class E2BTestServer(FakeE2BCloud):
    """A local E2B (control plane + envd) on 127.0.0.1, speaking E2B's wire protocol.

    Point the real SDK at it with `server.env()` (environment variables) or
    `server.sdk_options()` (keyword arguments for `Sandbox.create`, `Sandbox.list`, ...).
    Stopping it kills every sandbox container it created and removes the images its template
    builds made (unless `keep_images=True`).
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, **cloud_options: Any) -> None:
        super().__init__(**cloud_options)
        self.host = host
        self._requested_port = port
        self._socket: socket.socket | None = None
        self._edge_socket: socket.socket | None = None
        self._port: int | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment variables that make the unmodified SDK use this server.

        E2B_DEBUG must stay off: in debug mode the SDK skips kill() and set_timeout().
        """
        return {
            "E2B_API_KEY": self.api_key,
            "E2B_API_URL": self.url,
            "E2B_SANDBOX_URL": self.url,
            "E2B_DOMAIN": self.domain,
            "E2B_DEBUG": "false",
        }

    def sdk_options(self) -> dict[str, str]:
        """The same as keyword arguments (`api_key`, `api_url`, `sandbox_url`)."""
        return {"api_key": self.api_key, "api_url": self.url, "sandbox_url": self.url}

    def start(self) -> E2BTestServer:
        """Start serving (idempotent); returns once the port accepts requests."""
        if self._thread is not None:
            return self
        self.start_reaper()
        sockets = self._bind()
        self._socket = sockets[0]
        self._port = int(sockets[0].getsockname()[1])
        config = uvicorn.Config(
            E2BApp(self),
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=600,  # longer than the SDK pool's idle timeout (300 s)
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": sockets}, name="e2b-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("E2B test server failed to start")
            time.sleep(0.01)
        return self

    def _bind(self) -> list[socket.socket]:
        """The server's socket, and one on the same port at this host's address on the
        sandboxes' network: the edge (edge.py), which sandboxes reach by name."""
        edge = self.edge_address()
        for _ in range(50):
            # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and
            # without it each response's second write waits for a delayed ACK (~40 ms).
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
            sock.listen(128)
            if edge == self.host:
                return [sock]
            second = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            second.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                second.bind((edge, int(sock.getsockname()[1])))
            except OSError:  # that port is taken there: try another
                second.close()
                sock.close()
                if self._requested_port:
                    raise
                continue
            second.listen(128)
            self._edge_socket = second
            return [sock, second]
        raise RuntimeError(f"no port free on both {self.host} and {edge}")

    def stop(self) -> None:
        """Kill every sandbox, then stop serving."""
        try:
            self.shutdown()
        finally:
            if self._uvicorn is not None:
                self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
            if self._socket is not None:
                self._socket.close()
            if self._edge_socket is not None:
                self._edge_socket.close()
                self._edge_socket = None
            self._thread = None
            self._uvicorn = None

    def __enter__(self) -> E2BTestServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
