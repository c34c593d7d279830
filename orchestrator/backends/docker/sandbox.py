"""One run's Docker container as the runner holds it: its runtime's stdin (the request, once),
its attached output, its exit, its kill and its removal, with the helpers beside it (egress
proxy, model gateway, secret interceptor)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import docker
import docker.errors
from docker.utils.socket import frames_iter

from orchestrator_runtime.protocol import READY_LINE, RESTORED_LINE
from orchestrator_runtime.request import Request

from ...spec import Limits
from ..base import ExitInfo, Sandbox, SandboxSpec, StreamName
from .engine import engine_time
from .runtimes import Placement
from .snapshots import start_from_checkpoint

if TYPE_CHECKING:  # a run's helpers, imported only by the runs that have them (backend.py)
    from .egress import Egress
    from .gateway import Gateway
    from .interceptor import Interceptor

STREAM_NAMES: dict[int, StreamName] = {1: "stdout", 2: "stderr"}

#: The exit status of a container whose runtime, or the agent process its relay waits for,
#: was killed by SIGKILL (128 + 9): the kernel's OOM killer, or a kill.
SIGKILL_EXIT = 137
#: How long after a container's exit the host waits for the engine's `oom` event when the
#: engine's record says no OOM kill but the exit was a SIGKILL the host did not send
#: (`oom_killed`). An OOM notice that comes in after the exit's is still logged as the
#: container's `oom` event, just after its `die` (here 0.1-0.2 s before it, under load, when
#: in order); the wait ends at the event, so only a SIGKILL that was no OOM waits it out.
OOM_EVENT_GRACE = 3.0


def oom_killed(
    api: docker.APIClient, container_id: str, exit_code: int, state: dict[str, Any]
) -> bool:
    """Whether the kernel's OOM killer ended a process of the container, as the engine saw
    it. `state`: the container's inspected State, after its exit.

    The engine's record (State.OOMKilled) is set only when its OOM notice from containerd
    came in before the exit's. The OOM killer takes the largest process, the agent process;
    the runtime's relay outlives it, reports that it died without a result and exits 137 at
    once: on a loaded machine the exit's notice can then come first, and the record says no
    OOM (a run holding 768 MiB under 128 MiB ended `failed`). So for an exit by SIGKILL the
    engine's events are asked too: its `oom` event for the container, waited for until
    OOM_EVENT_GRACE after the exit (the event stream ends then). The caller leaves out the
    SIGKILLs it sent itself (a time limit, a cancel)."""
    if state.get("OOMKilled"):
        return True
    if exit_code != SIGKILL_EXIT:
        return False
    started = engine_time(state.get("StartedAt")) or time.time() - 24 * 3600
    finished = engine_time(state.get("FinishedAt")) or time.time()
    try:
        events = api.events(
            since=f"{started - 1:.9f}",  # the engine's own clock, as its records are
            until=f"{finished + OOM_EVENT_GRACE:.9f}",
            filters={"type": "container", "container": container_id, "event": "oom"},
            decode=True,
        )
    except docker.errors.APIError:
        return False
    try:
        return any(event.get("Action", event.get("status")) == "oom" for event in events)
    finally:
        events.close()


class DockerSandbox(Sandbox):
    """A created container; the stream is the attached stdout/stderr of the runtime."""

    def __init__(
        self,
        client: docker.DockerClient,
        container_id: str,
        egress: Egress | None = None,
        gateway: Gateway | None = None,
        spec: SandboxSpec | None = None,
        placement: Placement | None = None,
        interceptor: Interceptor | None = None,
    ) -> None:
        self.client = client
        self.api = client.api
        self.id = container_id
        self.egress = egress
        self.gateway: Gateway | None = gateway
        self.interceptor = interceptor
        self.secrets_proxy = interceptor
        #: What the egress proxy and the interceptor refused, merged in the order first
        #: seen (`egress_blocked`), and how much of each source is in it.
        self._attempts: list[dict[str, Any]] = []
        self._taken = {"squid": 0, "interceptor": 0}
        self.spec = spec
        self._socket: Any = None
        #: A pooled sandbox's output read while it became ready, and the rest of it.
        self._early: list[tuple[StreamName, bytes]] = []
        self._frames: Iterator[tuple[int, bytes]] | None = None
        limits = spec.limits if spec is not None else Limits()
        self.isolation = placement.isolation(limits) if placement else {}
        #: The snapshot it was restored from (snapshots.py); None: started cold.
        self.restored_from: str | None = None
        #: Whether this host killed it (`kill`).
        self._killed = False

    def start(self, request: Request, secrets: dict[str, str]) -> None:
        """The request and its secrets go in as one JSON object on the runtime's stdin: a
        read-only root leaves no other way in, and stdin is in no `docker inspect`. The
        model's key went to the gateway's stdin alone (`Gateway.open`)."""
        stdin = replace(request, secrets=secrets).to_json().encode()
        if not self.started:  # cold, and no gateway's start to overlap with (`_create_all`)
            self.prestart()
        if self.egress is not None:
            self.egress.wait_ready()  # squid started first; its start overlaps this one's
        # The interceptor listens by now: the runner opened it (`secrets_proxy.open`).
        if self.gateway is not None:
            self.gateway.wait_ready()
        raw: socket.socket = self._socket._sock
        raw.sendall(stdin)
        raw.shutdown(socket.SHUT_WR)  # EOF on the runtime's stdin (stdin_once)

    @property
    def started(self) -> bool:
        """Whether the container was started idle already (`prestart`)."""
        return self._socket is not None

    def prestart(self, checkpoint: str | None = None) -> None:
        """Start the container with its stdin open and nobody writing: the runtime imports
        what it needs and waits for its request. Output is attached before the start, so not
        a byte of it is missed; if this process dies, its stdin ends and so does the
        runtime (and the keeper's idle deadline holds in any case). `checkpoint`: start it
        from that checkpoint in its own folder (snapshots.py), and tell its runtime at once
        (RESTORED_LINE: it reseeds, and its keeper's idle time starts again now, not at the
        snapshot maker's start). Raises the engine's errors, OSError when the line cannot
        be written."""
        self._socket = self.api.attach_socket(
            self.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        )
        if checkpoint is None:
            self.api.start(self.id)
        else:
            start_from_checkpoint(self.api, self.id, checkpoint)
            self._socket._sock.sendall(RESTORED_LINE.encode())

    def wait_idle(self, timeout: float) -> None:
        """Until the runtime of a prestarted sandbox has imported everything (its READY_LINE
        on stderr). What it wrote before is kept for `stream`. Raises RuntimeError when the
        output ends first, or when it is not ready within `timeout` (it is killed then)."""
        self._frames = frames_iter(self._socket, tty=False)
        marker, seen = READY_LINE.encode(), b""
        watchdog = threading.Timer(timeout, self.kill)
        watchdog.daemon = True
        watchdog.start()
        try:
            for stream_id, chunk in self._frames:
                name = STREAM_NAMES.get(stream_id)
                if name == "stderr":
                    seen += chunk
                    if marker in seen:
                        self._early += [("stderr", p) for p in seen.split(marker, 1) if p]
                        return
                elif name and chunk:
                    self._early.append((name, chunk))
        except OSError:
            pass
        finally:
            watchdog.cancel()
        raise RuntimeError(
            f"the pooled sandbox ended before it was ready (within {timeout:g} s); its last "
            f"words: {seen[-500:].decode(errors='replace')!r}"
        )

    def take(self, spec: SandboxSpec) -> None:
        """Hand a pooled sandbox to the run of `spec` (its run id was the sandbox's from the
        start; its gateway's token is the run's own)."""
        if self.spec is None or spec.run_id != self.spec.run_id:
            raise ValueError(f"pooled sandbox {self.id[:12]} is not for run {spec.run_id}")
        self.spec = spec
        if self.gateway is not None and spec.gateway is not None:
            self.gateway.spec = spec.gateway

    def stream(self) -> Iterator[tuple[StreamName, bytes]]:
        yield from self._early
        self._early = []
        try:
            for stream_id, chunk in self._frames or frames_iter(self._socket, tty=False):
                name = STREAM_NAMES.get(stream_id)
                if name and chunk:
                    yield name, chunk
        except OSError:
            return  # closed under us (kill/remove): the exit state says what happened

    def wait(self, timeout: float) -> ExitInfo:
        """The container's exit. An OOM kill is decided by the host from the engine
        (`oom_killed`), never from what the sandbox said; a SIGKILL this host sent
        (`kill`: a time limit, a cancel) is not looked up as one."""
        try:
            result = self.api.wait(self.id, timeout=timeout)
            state = self.api.inspect_container(self.id)["State"]
            code = int(result.get("StatusCode", -1))
            killed = bool(state.get("OOMKilled")) or (
                not self._killed and oom_killed(self.api, self.id, code, state)
            )
        except docker.errors.NotFound:
            return ExitInfo(None, infra_error="the container vanished during the run")
        except Exception as exc:
            return ExitInfo(None, infra_error=f"waiting for the container failed: {exc}")
        return ExitInfo(code, oom_killed=killed)

    def recover_stdout(self) -> bytes:
        """Nothing: the sandbox keeps no engine-side log to recover from (see
        `host_config_options`), so a broken live stream ends the run without a result."""
        return b""

    def kill(self) -> None:
        self._killed = True  # its SIGKILL is this host's, not the OOM killer's (`wait`)
        with contextlib.suppress(docker.errors.APIError):
            self.api.kill(self.id)

    def health(self) -> str | None:
        """None while the sandbox can work; else why not (its egress proxy, secret
        interceptor or gateway is gone)."""
        lost = self.egress.alive() if self.egress else None
        if lost is None and self.interceptor is not None:
            lost = self.interceptor.alive()
        if lost is None and self.gateway is not None:
            lost = self.gateway.alive()
        return lost

    def egress_blocked(self, *, final: bool = False) -> list[dict[str, Any]]:
        """Requests the egress proxy and the secret interceptor refused (none without
        either): each source's new ones appended in time order at each call, so the list
        only grows, as the runner reads it (`final`: squid's log flushed first)."""
        sources = {
            "squid": self.egress.blocked(final=final) if self.egress else [],
            "interceptor": self.interceptor.attempts() if self.interceptor else [],
        }
        new: list[dict[str, Any]] = []
        for name, attempts in sources.items():
            new += attempts[self._taken[name] :]
            self._taken[name] = max(self._taken[name], len(attempts))
        self._attempts += sorted(new, key=lambda a: float(a.get("ts") or 0.0))
        return list(self._attempts)

    def remove_sandbox_only(self) -> None:
        """The sandbox's container (quick once it has exited); its network, proxy and
        gateway stay for `remove` (their removal takes far longer:
        benchmarks/results/code_figures.md#engine-calls)."""
        if self._socket is not None:
            with contextlib.suppress(Exception):
                self._socket.close()
        with contextlib.suppress(docker.errors.NotFound):
            self.api.remove_container(self.id, force=True, v=True)

    def remove(self) -> None:
        def remove_containers() -> None:
            helpers = [h.remove for h in (self.gateway, self.interceptor) if h is not None]
            workers = [threading.Thread(target=h, name="helper-remove") for h in helpers]
            for worker in workers:
                worker.start()
            try:
                self.remove_sandbox_only()
            finally:
                for worker in workers:
                    worker.join()

        if self.egress is None:
            remove_containers()
        else:  # every container at once, then the network
            self.egress.remove(also=remove_containers)
