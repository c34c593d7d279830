"""Docker backend: one fresh, hardened container per run, removed whatever happens."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import docker.errors
from docker.utils.socket import frames_iter

from orchestrator_runtime.protocol import READY_LINE
from orchestrator_runtime.request import Request

from ...errors import ConfigError
from ...gateway import starting_line
from ...labels import LABEL_KIND, LABEL_RUN_ID, LABEL_WARM
from ..base import (
    Capabilities,
    ExitInfo,
    Progress,
    Sandbox,
    SandboxInfo,
    SandboxSpec,
    StreamName,
)
from .deadline import AGENT_KEEPER, deadline_at, idle_kept, kept, run_seconds
from .egress import KIND_EGRESS_NETWORK, Egress, ensure_egress_image, remove_network
from .engine import connect, engine_time
from .gateway import Gateway
from .hardening import host_config_options, network_options
from .hostchecks import EngineHostChecks
from .interceptor import Interceptor, InterceptorRoute, ensure_interceptor_image
from .runtimes import RUNC, RUNSC, EngineRuntimes, Placement, check_requested, place

#: How long a pooled sandbox's runtime may take to import everything before it is given up.
IDLE_READY_TIMEOUT = 60.0
#: The unprivileged user of the agent image (see images/agent/Dockerfile).
SANDBOX_USER = "10001:10001"


STREAM_NAMES: dict[int, StreamName] = {1: "stdout", 2: "stderr"}


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
        self.isolation = placement.isolation() if placement else {}

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

    def prestart(self) -> None:
        """Start the container with its stdin open and nobody writing: the runtime imports
        what it needs and waits for its request. Output is attached before the start, so not
        a byte of it is missed; if this process dies, its stdin ends and so does the
        runtime (and the keeper's idle deadline holds in any case)."""
        self._socket = self.api.attach_socket(
            self.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        )
        self.api.start(self.id)

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
        try:
            result = self.api.wait(self.id, timeout=timeout)
            state = self.api.inspect_container(self.id)["State"]
        except docker.errors.NotFound:
            return ExitInfo(None, infra_error="the container vanished during the run")
        except Exception as exc:
            return ExitInfo(None, infra_error=f"waiting for the container failed: {exc}")
        return ExitInfo(int(result.get("StatusCode", -1)), oom_killed=bool(state.get("OOMKilled")))

    def recover_stdout(self) -> bytes:
        """Nothing: the sandbox keeps no engine-side log to recover from (see
        `host_config_options`), so a broken live stream ends the run without a result."""
        return b""

    def kill(self) -> None:
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

    def egress_blocked(self) -> list[dict[str, Any]]:
        """Requests the egress proxy and the secret interceptor refused (none without
        either): each source's new ones appended in time order at each call, so the list
        only grows, as the runner reads it."""
        sources = {
            "squid": self.egress.blocked() if self.egress else [],
            "interceptor": self.interceptor.attempts() if self.interceptor else [],
        }
        new: list[dict[str, Any]] = []
        for name, attempts in sources.items():
            new += attempts[self._taken[name] :]
            self._taken[name] = max(self._taken[name], len(attempts))
        self._attempts += sorted(new, key=lambda a: float(a.get("ts") or 0.0))
        return list(self._attempts)

    def remove_sandbox_only(self) -> None:
        """The sandbox's container (a few ms once it has exited); its network, proxy and
        gateway stay for `remove` (their removal takes about 0.3 s)."""
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


class DockerBackend(EngineHostChecks):
    """Sandboxes as containers on the local Docker engine (`connect`: EngineUnavailable)."""

    name = "docker"
    capabilities = Capabilities(
        warm_sandboxes=True,
        model_gateway="sidecar",
        resource_limits=True,
        egress_events=True,
        removes_orphans=True,
        orphans_end="its containers stop at their deadline",
        image_listing=True,
        base_bootstrap=True,
        sandbox_runtimes=(RUNSC, RUNC),
        bound_secrets=True,
    )

    def __init__(
        self,
        client: docker.DockerClient | None = None,
        *,
        base_image: str | None = None,
        interceptor_route: InterceptorRoute | None = None,
    ):
        """`interceptor_route`: for tests only, where a run's secret interceptor sends what
        it lets through in place of the run's squid (`InterceptorRoute`)."""
        self.client = client or connect()
        self.base_image = base_image
        self.interceptor_route = interceptor_route
        self.runtimes = EngineRuntimes(self.client)

    def check_runtime(self, runtime: str, *, asked: bool = True) -> None:
        """The name as `Backend`'s; runsc once `setup-gvisor.sh` registered it (`runtimes.py`)."""
        super().check_runtime(runtime, asked=asked)
        check_requested(runtime, self.runtimes)

    def starts_per_core(self, spec: SandboxSpec) -> int:
        """Two under gVisor, whose start waits as well as computes (its boot, its gofer): with
        one per core a warm batch of 64 mock tasks on 2 cores left 6 % of the CPU idle and
        sent 15-25 runs cold; with two, 4 %, as cold does, and one. One under runc, where two
        made warm 0.95x of cold at a fixed 4 (one: 1.05x)."""
        try:
            gvisor = place(spec.runtime, self.runtimes, networked=False).runtime == "runsc"
        except ConfigError:  # no gVisor for a run that asks for it: the run says so
            gvisor = False
        return 2 if gvisor else 1

    def prepare_image(self, extra_requirements: tuple[str, ...], progress: Progress) -> str:
        return self.build_image(self.base_image, extra_requirements, progress)

    def build_image(
        self, base: str | None, extra_requirements: tuple[str, ...], progress: Progress
    ) -> str:
        """The agent image on `base` (default: $ORCHESTRATOR_BASE_IMAGE, else the built-in
        one), and the payload image for `extra_requirements` on it."""
        from .images import ensure_agent_image

        return ensure_agent_image(
            self.client, base=base, extra_requirements=tuple(extra_requirements), progress=progress
        )

    def list_images(self) -> list[dict[str, Any]]:
        from .prune import list_images

        return list_images(self.client)

    def prune_images(self, *, dry_run: bool = False) -> list[str]:
        from .prune import prune_images

        return prune_images(self.client, dry_run=dry_run)

    def bootstrap_base(self, *, suite: str, mirror: str, progress: Progress) -> str:
        """A Debian base image from debootstrap + `docker import` (no registry needed)."""
        from .base_image import bootstrap_base

        return bootstrap_base(self.client, suite=suite, mirror=mirror, progress=progress)

    def create(self, spec: SandboxSpec, progress: Progress) -> DockerSandbox:
        """The sandbox container, and what its network policy needs beside it: a private
        network (allowlist, or any run with a gateway), squid on it (when the sandbox has
        hosts of its own to reach) and the model gateway. All removed again on failure."""
        return self._create_all(spec, progress, None)

    def create_idle(self, spec: SandboxSpec, progress: Progress, ttl: float) -> DockerSandbox:
        """A pooled sandbox: created exactly as `create` does (same hardening, labels, network
        and helpers), then started idle (`DockerSandbox.prestart`). Its keeper stops it `ttl`
        seconds from now unless a run takes it; a taken one stops at the run's time limit
        and grace after it read its request. Its helpers stop when an untaken sandbox would
        have ended its run at the latest. Everything carries `LABEL_WARM`."""
        return self._create_all(
            replace(spec, labels={**spec.labels, LABEL_WARM: "true"}), progress, ttl
        )

    def _create_all(
        self, spec: SandboxSpec, progress: Progress, ttl: float | None
    ) -> DockerSandbox:
        needs_proxy = spec.network.mode == "allowlist" and bool(
            spec.network.hosts or spec.network.endpoints or spec.network.host_endpoints
        )
        needs_network = spec.network.mode == "allowlist" or spec.gateway is not None
        proxy_image = interceptor_image = None
        if needs_proxy:
            proxy_image = ensure_egress_image(self.client, base=self.base_image, progress=progress)
        if spec.bindings:  # only runs with bound secrets pay for the interception
            if not needs_proxy:
                raise ValueError("bound secrets need an allowlist run's egress proxy")
            interceptor_image = ensure_interceptor_image(self.client, progress)
        # One stop time for every container of the run; a pooled sandbox's helpers also wait
        # out its time-to-live.
        stop_at = deadline_at(spec.limits) + (ttl or 0.0)
        egress = gateway = None
        interceptor: Interceptor | None = None
        sandbox: DockerSandbox | None = None
        command = list(spec.command)
        # The network first; then the model gateway starts in the background while squid (or,
        # without squid, the sandbox itself) starts: each start is about 0.25 s of engine
        # time. The sandbox's environment needs the gateway's address only beside squid.
        starting: Future[Gateway] | None = None
        starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-start")
        try:
            if needs_network:
                egress = Egress.start(
                    self.client,
                    run_id=spec.run_id,
                    labels=spec.labels,
                )
            if spec.gateway is not None and egress is not None:
                progress(starting_line(spec.gateway))
                starting = starter.submit(
                    Gateway.start,
                    self.client,
                    run_id=spec.run_id,
                    spec=spec.gateway,
                    network_id=egress.network_id,
                    network_name=egress.network_name,
                    labels=spec.labels,
                    image=spec.image,
                    stop_at=stop_at,
                )
            if egress is not None and proxy_image is not None:
                egress.start_proxy(
                    spec.run_id, spec.network, spec.labels, proxy_image, stop_at, progress
                )
                if interceptor_image is not None:
                    route = self.interceptor_route
                    interceptor = Interceptor.for_run(
                        self.client, spec, egress, interceptor_image, stop_at, route
                    )
                if starting is not None:
                    gateway = starting.result()
            if ttl is None:
                argv = kept(AGENT_KEEPER, stop_at, command)
            else:
                idle_until = time.time() + ttl
                argv = idle_kept(AGENT_KEEPER, idle_until, run_seconds(spec.limits), command)
            sandbox = self._create(spec, egress, gateway, argv, interceptor)
            if starting is not None and gateway is None:
                sandbox.prestart()  # the sandbox's start beside the gateway's
                sandbox.gateway = gateway = starting.result()
        except BaseException:
            if starting is not None and gateway is None:
                with contextlib.suppress(BaseException):
                    gateway = starting.result()
            if sandbox is not None:
                sandbox.remove_sandbox_only()
            if gateway is not None:
                gateway.remove()
            if interceptor is not None:
                interceptor.remove()
            if egress is not None:
                egress.remove()
            raise
        finally:
            starter.shutdown(wait=False)
        if ttl is None:
            return sandbox
        try:
            if not sandbox.started:
                sandbox.prestart()
            sandbox.wait_idle(IDLE_READY_TIMEOUT)
        except BaseException:
            sandbox.remove()
            raise
        return sandbox

    def _create(
        self,
        spec: SandboxSpec,
        egress: Egress | None,
        gateway: Gateway | None,
        entrypoint: list[str],
        interceptor: Interceptor | None = None,
    ) -> DockerSandbox:
        networked = network_options(spec.network, egress)["network_mode"] != "none"
        placement = place(spec.runtime, self.runtimes, networked=networked)
        options = host_config_options(spec, egress, placement)
        host_config = self.client.api.create_host_config(**options)
        direct = (gateway.ip,) if gateway is not None and gateway.ip else ()
        via = interceptor.proxy_url if interceptor is not None else None  # in squid's place
        container = self.client.api.create_container(
            image=spec.image,
            entrypoint=entrypoint,
            command=[],
            name=f"orchestrator-{spec.run_id}",
            user=SANDBOX_USER,
            working_dir="/work",
            environment=egress.proxy_env(direct, via) if egress else {},
            labels={**spec.labels, LABEL_KIND: "sandbox"},
            hostname="sandbox",
            stdin_open=True,  # the SDK sets StdinOnce with it: EOF ends the stdin
            tty=False,
            host_config=host_config,
        )
        if spec.network.mode == "open" and egress is not None:  # the bridge, and the gateway
            self.client.api.connect_container_to_network(container["Id"], egress.network_id)
        return DockerSandbox(
            self.client, container["Id"], egress, gateway, spec, placement, interceptor
        )

    def list_sandboxes(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Containers (sandboxes, egress proxies), then the runs' networks: in that order
        they can be removed."""
        filters = {"label": [f"{k}={v}" for k, v in labels.items()] or [LABEL_RUN_ID]}
        found = []
        for c in self.client.api.containers(all=True, filters=filters):
            info = SandboxInfo(
                id=c["Id"],
                name=(c.get("Names") or ["?"])[0].lstrip("/"),
                labels=c.get("Labels") or {},
                state=c.get("State", "?"),
                kind=(c.get("Labels") or {}).get(LABEL_KIND, "sandbox"),
            )
            found.append(self._with_end(info) if info.kind == "sandbox" else info)
        for n in self.client.api.networks(filters=filters):
            labels = n.get("Labels") or {}
            if labels.get(LABEL_KIND) == KIND_EGRESS_NETWORK:
                found.append(SandboxInfo(n["Id"], n["Name"], labels, "-", KIND_EGRESS_NETWORK))
        return found

    def _with_end(self, info: SandboxInfo) -> SandboxInfo:
        """The engine's record of how a container ended (exit code, OOM kill, times)."""
        try:
            state = self.client.api.inspect_container(info.id)["State"]
        except docker.errors.APIError:
            return info
        if state.get("Running") or state.get("Status") == "created":
            return info
        return replace(
            info,
            exit_code=state.get("ExitCode"),
            oom_killed=bool(state.get("OOMKilled")),
            started_at=engine_time(state.get("StartedAt")),
            finished_at=engine_time(state.get("FinishedAt")),
        )

    def remove_sandbox(self, info: SandboxInfo) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            if info.kind == KIND_EGRESS_NETWORK:
                remove_network(self.client, info.id)
            else:
                self.client.api.remove_container(info.id, force=True, v=True)
