"""One run's model gateway as a container (`orchestrator_runtime/gateway`, from the agent image).

It sits on the run's private network, where the sandbox reaches it, and on the default bridge,
from where it reaches the model (a server on the Docker host through `host-gateway`). It is
hardened like the egress proxy, carries the run's labels and the same deadline keeper, keeps
no engine-side log, and gets the model's key only through its stdin: never in its
environment, `docker inspect` or a file. It answers only clients of the run's network that
hold the run's token.

Its reports (one JSON line each on its stdout) are read live by a thread and handed to the
runner through `events()`: it is the sandbox's `GatewayHandle`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from docker.types import LogConfig

from ...errors import OrchestratorError
from ...gateway import GatewaySpec, read_report
from ...labels import LABEL_KIND
from ...policy import HOST_ALIAS
from ..base import GatewayHandle
from .deadline import AGENT_KEEPER, kept
from .engine import attached_lines, remove_attached, stopped
from .seccomp import security_options

if TYPE_CHECKING:
    import docker

#: The `orchestrator.kind` label of gateway containers.
KIND_GATEWAY = "gateway"
#: The gateway's port on the run's network.
GATEWAY_PORT = 8000
GATEWAY_COMMAND = ["python", "-m", "orchestrator_runtime.gateway"]
#: The gateway's limits: small, it only relays.
GATEWAY_MEMORY = "256m"
GATEWAY_PIDS = 64
GATEWAY_CPUS = 1.0
#: The unprivileged user of the agent image.
GATEWAY_USER = "10001:10001"
#: How long the gateway may take to listen, and to hand in its totals at the end.
READY_TIMEOUT = 20.0
CLOSE_TIMEOUT = 3.0
#: The longest report line kept (a line is a few hundred bytes; nothing is unbounded).
MAX_LINE = 64 * 1024


class GatewayError(OrchestratorError):
    """The model gateway could not be started (the run never starts without it)."""

    exit_code = 5


class Gateway(GatewayHandle):
    """The gateway container of one run, and the live reading of its reports."""

    def __init__(
        self,
        client: docker.DockerClient,
        container_id: str,
        network_name: str,
        spec: GatewaySpec,
        network_id: str = "",
    ):
        self.client = client
        self.container_id = container_id
        self.network_name = network_name
        self.network_id = network_id
        #: The run's gateway (a pooled sandbox's run sets its own: `DockerSandbox.take`).
        self.spec = spec
        self.ip: str | None = None
        self._socket: Any = None
        self._events: deque[dict[str, Any]] = deque()
        self._stderr: deque[str] = deque(maxlen=20)
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._reader: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        client: docker.DockerClient,
        *,
        run_id: str,
        spec: GatewaySpec,
        network_id: str,
        network_name: str,
        labels: dict[str, str],
        image: str,
        stop_at: float,
    ) -> Gateway:
        """Create and start the container on the run's network; it then waits for its
        configuration (`configure`). Removes the container again on failure."""
        api = client.api
        tmpfs = "rw,nosuid,nodev,noexec,size=16m,mode=1777"
        host_config = api.create_host_config(
            network_mode="bridge",  # outbound to the model; the run's network is added below
            cap_drop=["ALL"],  # port 8000 needs no capability
            security_opt=security_options(),
            runtime="runc",  # our code, not the payload's: no gVisor (runtimes.py)
            read_only=True,
            tmpfs={"/tmp": tmpfs},
            mem_limit=GATEWAY_MEMORY,
            memswap_limit=GATEWAY_MEMORY,
            nano_cpus=int(GATEWAY_CPUS * 1e9),
            pids_limit=GATEWAY_PIDS,
            ipc_mode="private",
            init=False,  # PID 1 is the deadline keeper
            extra_hosts={HOST_ALIAS: "host-gateway"} if spec.on_this_host else None,
            log_config=LogConfig(type="none"),  # the key and the calls stay off the disk
        )
        container = api.create_container(
            image=image,
            entrypoint=kept(AGENT_KEEPER, stop_at, GATEWAY_COMMAND),
            command=[],
            name=f"orchestrator-gateway-{run_id}",
            user=GATEWAY_USER,
            working_dir="/tmp",
            labels={**labels, LABEL_KIND: KIND_GATEWAY},
            hostname="gateway",
            stdin_open=True,
            tty=False,
            host_config=host_config,
        )
        gateway = cls(client, container["Id"], network_name, spec, network_id)
        try:
            api.connect_container_to_network(gateway.container_id, network_id)
            gateway._socket = api.attach_socket(
                gateway.container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            )
            api.start(gateway.container_id)
            networks = api.inspect_container(gateway.container_id)["NetworkSettings"]["Networks"]
            gateway.ip = networks[network_name]["IPAddress"]
            gateway._reader = threading.Thread(target=gateway._read, name="gateway-reports")
            gateway._reader.daemon = True
            gateway._reader.start()
        except BaseException:
            gateway.remove()
            raise
        return gateway

    @property
    def api_base(self) -> str:
        """The URL the sandbox uses: this gateway, with the upstream's base path."""
        path = urlsplit(self.spec.upstream).path.rstrip("/")
        return f"http://{self.ip}:{GATEWAY_PORT}{path}"

    def open(self, key: str | None) -> None:
        """Hand the gateway its configuration, the key included, on its stdin; it answers
        only the run's network (its address ranges) and the run's token."""
        ipam = self.client.api.inspect_network(self.network_id)["IPAM"]["Config"]
        config = self.spec.stdin_config(key, [c["Subnet"] for c in ipam], GATEWAY_PORT)
        self._socket._sock.sendall(json.dumps(config).encode() + b"\n")

    def wait_ready(self) -> None:
        """Until the gateway listens; raises GatewayError with its last words if it will not."""
        deadline = time.monotonic() + READY_TIMEOUT
        while not self._ready.wait(timeout=0.02):
            if self.alive() is not None or time.monotonic() > deadline:
                raise GatewayError(
                    "The model gateway did not start. Its last output:\n"
                    + ("\n".join(self._stderr) or "(none)"),
                    "Rebuild the agent image (`orchestrator images prune`, then run again), or "
                    "run with --no-gateway.",
                )

    def _read(self) -> None:
        """Reports from stdout, one JSON object a line; stderr kept for diagnostics."""
        try:
            for stream_id, line in attached_lines(self._socket, MAX_LINE):
                self._line(stream_id, line)
        finally:
            self._closed.set()

    def _line(self, stream_id: int, line: bytes) -> None:
        text = line.decode("utf-8", "replace").strip()
        if stream_id != 1:
            if text:
                self._stderr.append(text)
            return
        event = read_report(text)
        if event is None:
            return
        if event["type"] == "gateway_ready":
            self._ready.set()
            return
        self._events.append(event)
        if event["type"] == "gateway_closed":
            self._closed.set()

    def events(self) -> list[dict[str, Any]]:
        taken = []
        while self._events:
            taken.append(self._events.popleft())
        return taken

    def close(self) -> None:
        """Tell the gateway the run has ended and wait (briefly) for its totals."""
        if self._socket is None or not self._ready.is_set():
            return
        with contextlib.suppress(OSError):
            self._socket._sock.sendall(b"stop\n")
        self._closed.wait(timeout=CLOSE_TIMEOUT)

    def alive(self) -> str | None:
        """None while the gateway runs; else why the sandbox has lost its model."""
        return stopped(
            self.client,
            self.container_id,
            "model gateway",
            "the sandbox could not reach its model from then on",
        )

    def remove(self) -> None:
        """Remove the container; idempotent."""
        remove_attached(self.client, self.container_id, self._socket)
