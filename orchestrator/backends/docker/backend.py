"""Docker backend: one fresh, hardened container per run (sandbox.py), removed whatever
happens."""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import docker.errors

from ...errors import ConfigError
from ...gateway import GatewaySpec, starting_line
from ...labels import LABEL_KIND, LABEL_RUN_ID, LABEL_WARM
from ..base import (
    AUTO_RUNTIME,
    Capabilities,
    ImageStore,
    Progress,
    SandboxInfo,
    SandboxSpec,
    WarmSandboxes,
)
from . import snapshot_store, snapshots
from .deadline import AGENT_KEEPER, deadline_at, idle_kept, kept, restorable_kept, run_seconds
from .engine import connect, engine_time
from .hardening import host_config_options, network_options
from .hostchecks import EngineHostChecks
from .runtimes import RUNC, RUNSC, RUNSC_DIRECT, EngineRuntimes, check_requested, place
from .sandbox import DockerSandbox
from .snapshots import Snapshots

if TYPE_CHECKING:  # a run's helpers: imported by the runs that have them (`_create_all`)
    from concurrent.futures import Future, ThreadPoolExecutor

    from .egress import Egress
    from .gateway import Gateway
    from .interceptor import Interceptor, InterceptorRoute
    from .runsc_direct.sandbox import RunscSandbox  # and runsc_direct/ by its runs only

#: How long a pooled sandbox's runtime may take to import everything before it is given up.
IDLE_READY_TIMEOUT = 60.0
#: The unprivileged user of the agent image (see images/agent/Dockerfile).
SANDBOX_USER = "10001:10001"


def gateway_starting(
    client: docker.DockerClient,
    spec: SandboxSpec,
    gateway: GatewaySpec,
    egress: Egress,
    stop_at: float,
) -> tuple[ThreadPoolExecutor, Future[Gateway]]:
    """The run's model `gateway` starting on a thread of its own, on the run's network
    (`egress`), while the caller starts the rest; only such a run makes the thread."""
    from concurrent.futures import ThreadPoolExecutor

    from .gateway import Gateway

    starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-start")
    starting = starter.submit(
        Gateway.start,
        client,
        run_id=spec.run_id,
        spec=gateway,
        network_id=egress.network_id,
        network_name=egress.network_name,
        labels=spec.labels,
        image=spec.image,
        stop_at=stop_at,
    )
    return starter, starting


class DockerBackend(EngineHostChecks, WarmSandboxes, ImageStore):
    """Sandboxes as containers on the local Docker engine (`connect`: EngineUnavailable)."""

    name = "docker"
    capabilities = Capabilities(
        model_gateway="sidecar",
        resource_limits=True,
        egress_events=True,
        removes_orphans=True,
        orphans_end="its containers stop at their deadline",
        sandbox_runtimes=(RUNSC, RUNC, RUNSC_DIRECT),
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
        self.snapshots = Snapshots(self.client, self.runtimes.info)
        #: Whether this host can run runsc-direct (`direct.why_not_here`), asked once.
        self._direct: bool | None = None

    def runtime_for(self, requested: str) -> str:
        """The runtime a sandbox asked to run on `requested` gets. `auto` is, in this order:
        runsc-direct where this host can run it (runsc on PATH, sandbox cgroups this process
        can make: gVisor restored from a snapshot by runsc itself, with or without the
        engine's experimental mode), runsc where the engine has gVisor registered, else
        runc. Any other name is itself. The record keeps what was asked for (`requested:
        auto`)."""
        if requested != AUTO_RUNTIME:
            return requested
        if self._direct_here():
            return RUNSC_DIRECT
        return RUNSC if self.runtimes.has_gvisor() else RUNC

    def _direct_here(self) -> bool:
        if self._direct is None:
            from .runsc_direct import direct

            self._direct = direct.why_not_here() is None
        return self._direct

    def check_runtime(self, runtime: str, *, asked: bool = True) -> None:
        """The name as `Backend`'s; runsc once `setup-gvisor.sh` registered it (`runtimes.py`);
        runsc-direct where this host can run it. `auto` asks the engine for its runtimes in
        the background, unless it is runsc-direct here (which needs nothing of them)."""
        super().check_runtime(runtime, asked=asked)
        if runtime == RUNSC_DIRECT:
            from .runsc_direct import direct

            refused = direct.unavailable()
            if refused is not None:
                raise refused
            return
        if runtime == AUTO_RUNTIME and self._direct_here():
            return
        check_requested(runtime, self.runtimes)

    def starts_per_core(self, spec: SandboxSpec) -> int:
        """Two under gVisor, whose start waits as well as computes (its boot, its gofer): with
        one per core a warm batch left the CPU idler and sent many runs cold. One under runc,
        where two made a warm batch slower than a cold one (figures:
        benchmarks/results/code_figures.md#sandbox-starts-per-core)."""
        if self.runtime_for(spec.runtime) == RUNSC_DIRECT:
            return 2
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

    def create(self, spec: SandboxSpec, progress: Progress) -> DockerSandbox | RunscSandbox:
        """The sandbox container, and what its network policy needs beside it: a private
        network (allowlist, or any run with a gateway), squid on it (when the sandbox has
        hosts of its own to reach) and the model gateway. All removed again on failure.
        On `runsc-direct` (and `auto` where it is that), a sandbox runsc runs itself
        (runsc_direct/)."""
        if self.runtime_for(spec.runtime) == RUNSC_DIRECT:
            from .runsc_direct import direct

            if not direct.networked(spec):
                return direct.create(self.client, spec, progress)
            return self._held(spec, progress, None)
        return self._create_all(spec, progress, None)

    def _held(self, spec: SandboxSpec, progress: Progress, ttl: float | None) -> RunscSandbox:
        """A networked runsc-direct sandbox: its holder container made as this path's
        sandbox would be (network, proxy, gateway, interceptor; a pooled one's helpers live
        its time-to-live longer), then the sandbox in the holder's network namespace."""
        from .runsc_direct import direct

        limits = replace(spec.limits, timeout_seconds=spec.limits.timeout_seconds + (ttl or 0))
        holder = replace(
            spec,
            runtime=RUNC,
            command=direct.HOLDER_COMMAND,
            labels={**spec.labels, LABEL_KIND: direct.KIND_HOLDER},
            limits=limits,
        )
        made = self._create_all(holder, progress, None)  # with what is beside it
        return direct.beside(self.client, spec, made, progress, idle=ttl)

    def create_idle(
        self, spec: SandboxSpec, progress: Progress, ttl: float
    ) -> DockerSandbox | RunscSandbox:
        """A pooled sandbox: created exactly as `create` does (same hardening, labels, network
        and helpers), then started idle (`DockerSandbox.prestart`), or restored from its
        snapshot where a run's would be (snapshots.py). Its keeper stops it `ttl` seconds
        from now unless a run takes it; a taken one stops at the run's time limit and grace
        after it read its request. Its helpers stop when an untaken sandbox would
        have ended its run at the latest. Everything carries `LABEL_WARM`."""
        warm = replace(spec, labels={**spec.labels, LABEL_WARM: "true"})
        if self.runtime_for(spec.runtime) == RUNSC_DIRECT:
            from .runsc_direct import direct

            if direct.networked(warm):
                return self._held(warm, progress, ttl)
            return direct.create(self.client, warm, progress, idle=ttl)
        return self._create_all(warm, progress, ttl)

    def _create_all(
        self, spec: SandboxSpec, progress: Progress, ttl: float | None
    ) -> DockerSandbox:
        # A run's helpers' code is imported by the runs that have them (a cost on every start).
        from .egress import Egress, ensure_egress_image
        from .interceptor import Interceptor, ensure_interceptor_image

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
        # The network first; then the gateway starts in the background while squid (or, without
        # squid, the sandbox itself) starts: each is slow (results/code_figures.md#engine-calls).
        # The sandbox's environment needs the gateway's address only beside squid.
        starting: Future[Gateway] | None = None
        starter: ThreadPoolExecutor | None = None
        try:
            if needs_network:
                egress = Egress.start(
                    self.client,
                    run_id=spec.run_id,
                    labels=spec.labels,
                )
            if spec.gateway is not None and egress is not None:
                progress(starting_line(spec.gateway))
                starter, starting = gateway_starting(
                    self.client, spec, spec.gateway, egress, stop_at
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
            if egress is None:
                sandbox = self._restored(spec, command, progress, ttl)
            if ttl is None:
                argv = kept(AGENT_KEEPER, stop_at, command)
            else:
                idle_until = time.time() + ttl
                argv = idle_kept(AGENT_KEEPER, idle_until, run_seconds(spec.limits), command)
            if sandbox is None:
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
            if starter is not None:
                starter.shutdown(wait=False)
        if ttl is None:
            return sandbox
        try:
            if not sandbox.started:
                sandbox.prestart()
            if sandbox.restored_from is None:  # a restored one was ready when checkpointed
                sandbox.wait_idle(IDLE_READY_TIMEOUT)
        except BaseException:
            sandbox.remove()
            raise
        return sandbox

    def _restored(
        self, spec: SandboxSpec, command: list[str], progress: Progress, ttl: float | None
    ) -> DockerSandbox | None:
        """The run's sandbox restored from its snapshot, started; None: it starts cold. A
        pooled one (`ttl`) idles that long after its restore, a run's own RESTORABLE_IDLE:
        the idle time is in the keeper's argv, so pools and single runs have a snapshot
        each (one per time-to-live)."""
        if not snapshot_store.enabled():
            return None
        placement = place(spec.runtime, self.runtimes, networked=False)
        if not snapshots.covered(spec, placement):
            return None
        idle = snapshots.RESTORABLE_IDLE if ttl is None else ttl
        argv = restorable_kept(AGENT_KEEPER, idle, run_seconds(spec.limits), command)
        return self.snapshots.restored(
            spec,
            placement,
            config=self._config(spec, None, None, argv, None),
            create=lambda s, kind: self._create(s, None, None, argv, kind=kind),
            progress=progress,
            pooled=ttl is not None,
        )

    def _config(
        self,
        spec: SandboxSpec,
        egress: Egress | None,
        gateway: Gateway | None,
        entrypoint: list[str],
        interceptor: Interceptor | None,
    ) -> dict[str, Any]:
        """The container's whole configuration but its name and labels, as
        `create_container` keyword arguments (its host configuration rendered)."""
        networked = network_options(spec.network, egress)["network_mode"] != "none"
        placement = place(spec.runtime, self.runtimes, networked=networked)
        options = host_config_options(spec, egress, placement)
        direct = (gateway.ip,) if gateway is not None and gateway.ip else ()
        via = interceptor.proxy_url if interceptor is not None else None  # in squid's place
        return {
            "image": spec.image,
            "entrypoint": entrypoint,
            "command": [],
            "user": SANDBOX_USER,
            "working_dir": "/work",
            "environment": egress.proxy_env(direct, via) if egress else {},
            "hostname": "sandbox",
            "stdin_open": True,  # the SDK sets StdinOnce with it: EOF ends the stdin
            "tty": False,
            "host_config": self.client.api.create_host_config(**options),
        }

    def _create(
        self,
        spec: SandboxSpec,
        egress: Egress | None,
        gateway: Gateway | None,
        entrypoint: list[str],
        interceptor: Interceptor | None = None,
        kind: str = "sandbox",
    ) -> DockerSandbox:
        networked = network_options(spec.network, egress)["network_mode"] != "none"
        placement = place(spec.runtime, self.runtimes, networked=networked)
        container = self.client.api.create_container(
            name=f"orchestrator-{spec.run_id}",
            labels={LABEL_KIND: kind, **spec.labels},  # a spec's own kind first (a holder's)
            **self._config(spec, egress, gateway, entrypoint, interceptor),
        )
        if spec.network.mode == "open" and egress is not None:  # the bridge, and the gateway
            self.client.api.connect_container_to_network(container["Id"], egress.network_id)
        return DockerSandbox(
            self.client, container["Id"], egress, gateway, spec, placement, interceptor
        )

    def list_sandboxes(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Containers (sandboxes, egress proxies), then the runs' networks: in that order
        they can be removed."""
        from .egress import KIND_EGRESS_NETWORK
        from .runsc_direct import direct

        labels_wanted = dict(labels)
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
        return found + direct.list_sandboxes(labels_wanted)

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
        """An orphan (`cleanup`); a container's removal also sweeps what containerd
        unpacked for restores whose containers are gone (`Snapshots.sweep`)."""
        from .egress import KIND_EGRESS_NETWORK, remove_network
        from .runsc_direct import direct
        from .runsc_direct.records import is_ours

        if is_ours(info.id):  # run by runsc itself (runsc_direct/)
            direct.remove(info.id)
            return
        with contextlib.suppress(docker.errors.NotFound):
            if info.kind == KIND_EGRESS_NETWORK:
                remove_network(self.client, info.id)
                return
            self.client.api.remove_container(info.id, force=True, v=True)
        self.snapshots.sweep()
