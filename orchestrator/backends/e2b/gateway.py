"""One run's model gateway in an E2B sandbox of its own (`orchestrator_runtime/gateway`, run
from the run's own template, which carries it).

The run's sandbox reaches it at E2B's per-port host name (`Sandbox.get_host(GATEWAY_PORT)`),
the one host it may reach beside the payload's own; the gateway's sandbox may reach only the
model's endpoint. The key goes in as the gateway process's stdin, nothing else: never a
sandbox-level environment variable, the command's environment or a file. The gateway answers
only the run's token (its clients come through E2B's edge, so no address range can say who
they are); its reports (one JSON line each on its stdout) are read live by a thread and handed
to the runner through `events()` (`GatewayReports`, as Docker's): it is the sandbox's
`GatewayHandle`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ...gateway import GatewaySpec, starting_line
from ...labels import LABEL_KIND
from ..base import Progress
from ..gateway_reports import MAX_LINE, GatewayReports, Line
from .templates import PYTHON, RUNTIME_ENV, SANDBOX_USER

if TYPE_CHECKING:
    import e2b

#: The `orchestrator.kind` metadata of gateway sandboxes.
KIND_GATEWAY = "gateway"
#: The gateway's port in its sandbox (reached as `<port>-<sandbox id>.<domain>`).
GATEWAY_PORT = 8000
GATEWAY_COMMAND = f"exec {PYTHON} -m orchestrator_runtime.gateway"
#: How long the gateway may take to listen once configured.
READY_TIMEOUT = 30.0
#: Any client address: on E2B they all come through its edge; the run token decides.
ANY_CLIENT = ["0.0.0.0/0", "::/0"]


def port_url(sandbox: e2b.Sandbox, port: int) -> str:
    """A sandbox port's URL as E2B serves it: `https://<port>-<sandbox id>.<domain>`. With
    `E2B_SANDBOX_URL` set (a local or self-hosted E2B whose sandbox proxy is that one URL, as
    the tests' server), the host name is the same and the scheme and port are that URL's."""
    host = sandbox.get_host(port)
    proxy = urlsplit(os.environ.get("E2B_SANDBOX_URL") or "")
    if proxy.scheme and proxy.hostname:
        return f"{proxy.scheme}://{host}" + (f":{proxy.port}" if proxy.port else "")
    return f"https://{host}"


def gateway_network(upstream: str) -> dict[str, Any]:
    """The gateway sandbox's network: the model's endpoint, nothing else."""
    return {"deny_out": ["0.0.0.0/0"], "allow_out": [urlsplit(upstream).hostname or ""]}


class E2BGateway(GatewayReports):
    """The gateway sandbox of one run, and the live reading of its reports."""

    def __init__(self, sandbox: e2b.Sandbox, spec: GatewaySpec, call: Callable[..., Any]):
        super().__init__()
        self.sandbox = sandbox
        self.spec = spec
        self.id: str = sandbox.sandbox_id
        self._call = call  # the backend's retried call (`what` names it in errors)
        self._handle: Any = None
        self._lost: str | None = None
        self._removed = False

    @classmethod
    def start(
        cls,
        create: Callable[..., e2b.Sandbox],
        call: Callable[..., Any],
        *,
        template: str,
        spec: GatewaySpec,
        labels: dict[str, str],
        lifetime: int,
        progress: Progress,
    ) -> E2BGateway:
        """Create the gateway's sandbox (`create`: the backend's retried `Sandbox.create`) and
        start the gateway in it, waiting for its configuration (`open`). Kills the sandbox
        again on failure."""
        progress(starting_line(spec))
        sandbox = create(
            template=template,
            timeout=lifetime,
            metadata={**labels, LABEL_KIND: KIND_GATEWAY},
            network=gateway_network(spec.upstream),
        )
        gateway = cls(sandbox, spec, call)
        try:
            gateway._handle = call(
                lambda: sandbox.commands.run(
                    GATEWAY_COMMAND,
                    background=True,
                    stdin=True,
                    envs=dict(RUNTIME_ENV),
                    user=SANDBOX_USER,
                    cwd="/tmp",
                    timeout=0,  # no limit on the connection: the sandbox's lifetime is
                ),
                "gateway start",
            )
            gateway._start_reader(gateway._lines(), "e2b-gateway-reports")
        except BaseException:
            gateway.remove()
            raise
        return gateway

    @property
    def host(self) -> str:
        """The gateway's host name, the one the run's sandbox must be allowed to reach."""
        return str(self.sandbox.get_host(GATEWAY_PORT))

    @property
    def api_base(self) -> str:
        """The URL the sandbox uses: this gateway, with the upstream's base path."""
        path = urlsplit(self.spec.upstream).path.rstrip("/")
        return port_url(self.sandbox, GATEWAY_PORT) + path

    def open(self, key: str | None) -> None:
        """Hand the gateway its configuration, the key included, as its stdin, and wait until
        it listens; raises GatewayError with its last words if it will not."""
        config = self.spec.stdin_config(key, ANY_CLIENT, GATEWAY_PORT)
        line = json.dumps(config) + "\n"
        self._call(lambda: self.sandbox.commands.send_stdin(self._handle.pid, line), "gateway open")
        self._wait_ready(
            READY_TIMEOUT,
            self._ended.is_set,
            " in its E2B sandbox",
            "Rebuild the template (`orchestrator images build --backend e2b`), or run with "
            "--no-gateway.",
        )

    def _lines(self) -> Iterator[Line]:
        """Its output's lines, until it ends; why it ended is kept for `alive`."""
        partial = {"stdout": "", "stderr": ""}
        try:
            for stdout, stderr, _pty in self._handle:
                name, chunk = ("stdout", stdout) if stdout else ("stderr", stderr or "")
                *lines, rest = (partial[name] + chunk).split("\n")
                partial[name] = rest[-MAX_LINE:]
                for line in lines:
                    yield name == "stdout", line[:MAX_LINE]
            self._lost = "the model gateway ended"
        except Exception as exc:  # the sandbox went away, or we killed it
            self._lost = f"the model gateway's E2B sandbox was lost ({type(exc).__name__})"

    def _send(self, line: str) -> None:
        self.sandbox.commands.send_stdin(self._handle.pid, line)

    def alive(self) -> str | None:
        """None while the gateway serves; else why the sandbox has lost its model."""
        if self._removed or self._closed.is_set() or not self._ended.is_set():
            return None
        return f"{self._lost}: the sandbox could not reach its model from then on"

    def remove(self) -> None:
        """Kill the gateway's sandbox; idempotent, never raises (its lifetime ends it)."""
        if self._removed:
            return
        self._removed = True
        with contextlib.suppress(Exception):
            self._call(self.sandbox.kill, "gateway kill")
