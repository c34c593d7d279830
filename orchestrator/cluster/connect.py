"""Reaching a Ray cluster: Ray imported only when asked for (an optional extra), the
driver connected once, and the nodes that run sandboxes found by their custom resource.

Why Ray: it is the cluster engine our users already run for Python batch work over a fleet
(agent-training stacks drive their sandboxes from it); we use its actors, node affinity and
custom resources, nothing else, so the batch keeps every rule of its own.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..errors import ConfigError

#: The custom resource a node declares to run sandboxes, and how many at once:
#: `ray start ... --resources '{"orchestrator_sandboxes": 8}'`.
RESOURCE = "orchestrator_sandboxes"

INSTALL_FIX = (
    "Install the extra on this machine and on every node: pip install 'orchestrator[ray]' "
    "(or leave out --ray to run on this host)."
)

#: Seconds to wait for the head's port to answer before refusing the address.
PROBE_SECONDS = 10.0

#: The signals the CLI turns into a stop request (cli/signals.py), kept through `ray.init`.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.Lock()
_connected: str | None = None


def import_ray() -> ModuleType:
    """The `ray` module; ConfigError (exit 2) saying how to install it when it is absent."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"--ray needs the `ray` package, which is not installed here ({exc}).", INSTALL_FIX
        ) from exc
    return ray


def resolve_address(address: str | None) -> str:
    """The cluster to join: the one given, else $RAY_ADDRESS (Ray's own convention), else
    `auto` (a cluster started on this machine with `ray start`)."""
    return address or os.environ.get("RAY_ADDRESS") or "auto"


def connect(address: str | None) -> ModuleType:
    """Join the cluster at `address` once per process (later calls reuse the connection).
    Raises ConfigError (exit 2) when Ray is missing or no cluster answers there."""
    global _connected
    ray = import_ray()
    where = resolve_address(address)
    with _lock:
        if ray.is_initialized():
            return ray
        _probe(where)
        main = threading.current_thread() is threading.main_thread()
        saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if main else {}
        try:
            ray.init(
                address=where,
                log_to_driver=False,  # the nodes' worker output stays in their Ray logs
                logging_level="WARNING",
                configure_logging=True,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(
                f"Cannot join the Ray cluster at {where!r}: {exc}",
                "Start one (`ray start --head --resources '{\"orchestrator_sandboxes\": 4}'`), "
                "or pass its address (--ray HOST:PORT or RAY_ADDRESS).",
            ) from exc
        finally:  # Ray's core installs its own SIGTERM handler (a stack dump, then death):
            for sig, handler in saved.items():  # ours stop the batch cleanly instead
                if handler is not None:
                    signal.signal(sig, handler)
        _connected = where
    return ray


def disconnect() -> None:
    """Leave the cluster `connect` joined, once this process's executors are closed (no-op
    otherwise). Ray's own exit hook would do it later, while finalizers may still release
    objects, and Ray ends a process that touches it after that with exit status 1."""
    global _connected
    with _lock:
        if _connected is None:
            return
        ray = import_ray()
        gc.collect()  # references and actor handles go now, while Ray can still take them
        ray.shutdown()
        _connected = None


def _probe(where: str) -> None:
    """A HOST:PORT that nothing listens on is refused at once (Ray itself retries for
    minutes before it gives up on an address)."""
    host, _, port = where.rpartition("://")[2].rpartition(":")
    if not host or not port.isdigit():
        return  # `auto`, or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise ConfigError(
            f"Cannot join the Ray cluster at {where!r}: nothing answers there "
            f"({exc.strerror or exc}).",
            "Check the head's address and port (`ray status` on the head prints it), or start "
            "one: ray start --head --include-dashboard=false.",
        ) from exc


@dataclass(frozen=True)
class NodeInfo:
    """A node that declares `orchestrator_sandboxes`: Ray's node id, its address, its
    host name as Ray knows it, and how many sandboxes it runs at once."""

    node_id: str
    address: str
    hostname: str
    capacity: int

    def describe(self) -> dict[str, Any]:
        """The node as a run's record names it (`RunResult.node`)."""
        return {"node_id": self.node_id, "address": self.address, "hostname": self.hostname}

    def short(self) -> str:
        return f"{self.node_id[:12]} ({self.address})"


def sandbox_nodes(ray: ModuleType) -> list[NodeInfo]:
    """The live nodes that declare `orchestrator_sandboxes` (at least one)."""
    found = []
    for node in ray.nodes():
        capacity = int(node.get("Resources", {}).get(RESOURCE, 0))
        if node.get("Alive") and capacity >= 1:
            found.append(
                NodeInfo(
                    node_id=node["NodeID"],
                    address=node.get("NodeManagerAddress", "?"),
                    hostname=node.get("NodeManagerHostname", "?"),
                    capacity=capacity,
                )
            )
    return found
