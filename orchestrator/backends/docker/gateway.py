"""One run's model gateway as a container (`orchestrator_runtime/gateway`, from the agent image).

It sits on the run's private network, where the sandbox reaches it, and on the default bridge,
from where it reaches the model (a server on the Docker host through `host-gateway`). It is
hardened like the egress proxy, carries the run's labels and the same deadline keeper, keeps
no engine-side log, and gets the model's key only through its stdin: never in its
environment, `docker inspect` or a file. It answers only clients of the run's network that
hold the run's token.

Its reports (one JSON line each on its stdout) are read live by a thread and handed to the
runner through `events()` (`GatewayReports`, as E2B's): it is the sandbox's `GatewayHandle`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ...gateway import GatewaySpec
from ...policy import HOST_ALIAS
from ..gateway_reports import MAX_LINE, GatewayReports
from .deadline import AGENT_KEEPER, kept
from .engine import attached_lines, remove_attached, stopped
from .helper import HelperLimits, create_helper, start_attached

if TYPE_CHECKING:
    import docker

#: The `orchestrator.kind` label of gateway containers.
KIND_GATEWAY = "gateway"
#: The gateway's port on the run's network.
GATEWAY_PORT = 8000
GATEWAY_COMMAND = ["python", "-m", "orchestrator_runtime.gateway"]
#: The gateway's limits: small, it only relays.
GATEWAY_LIMITS = HelperLimits(memory="256m", pids=64, cpus=1.0)
#: The unprivileged user of the agent image.
GATEWAY_USER = "10001:10001"
#: How long the gateway may take to listen.
READY_TIMEOUT = 20.0


class Gateway(GatewayReports):
    """The gateway container of one run, and the live reading of its reports."""

    def __init__(
        self,
        client: docker.DockerClient,
        container_id: str,
        network_name: str,
        spec: GatewaySpec,
        network_id: str = "",
    ):
        super().__init__()
        self.client = client
        self.container_id = container_id
        self.network_name = network_name
        self.network_id = network_id
        #: The run's gateway (a pooled sandbox's run sets its own: `DockerSandbox.take`).
        self.spec = spec
        self.ip: str | None = None
        self._socket: Any = None

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
        container_id = create_helper(
            api,
            kind=KIND_GATEWAY,
            run_id=run_id,
            image=image,
            entrypoint=kept(AGENT_KEEPER, stop_at, GATEWAY_COMMAND),
            labels=labels,
            network_mode="bridge",  # outbound to the model; the run's network is added below
            limits=GATEWAY_LIMITS,
            user=GATEWAY_USER,
            extra_hosts={HOST_ALIAS: "host-gateway"} if spec.on_this_host else None,
        )
        gateway = cls(client, container_id, network_name, spec, network_id)
        try:
            api.connect_container_to_network(container_id, network_id)
            gateway._socket, gateway.ip = start_attached(api, container_id, network_name)
            lines = attached_lines(gateway._socket, MAX_LINE)
            gateway._start_reader(
                ((sid == 1, raw.decode("utf-8", "replace")) for sid, raw in lines),
                "gateway-reports",
            )
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
        self._wait_ready(
            READY_TIMEOUT,
            lambda: self.alive() is not None,
            "",
            "Rebuild the agent image (`orchestrator images prune`, then run again), or run "
            "with --no-gateway.",
        )

    def _send(self, line: str) -> None:
        self._socket._sock.sendall(line.encode())

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
