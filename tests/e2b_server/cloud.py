"""The state of the fake E2B cloud: sandboxes, their containers, faults and counters.

All methods are blocking and thread-safe; the HTTP layer calls them from worker threads and
tests call them directly.
"""

from __future__ import annotations

import os
import secrets
import string
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import docker

from .docker_sandbox import (
    LABEL,
    LABEL_INSTANCE,
    LABEL_OWNER_PID,
    LABEL_SANDBOX,
    ContainerGone,
    SandboxContainer,
    UserInfo,
    docker_client,
    list_containers,
    reap_orphan_images,
    reap_orphans,
)
from .edge import Resolver, network_gateway
from .errors import ApiError
from .processes import ManagedProcess
from .templates import TemplateBuild, TemplateBuilds, run_start_command

DEFAULT_IMAGE = "orchestrator-base:bookworm"
DEFAULT_API_KEY = "e2b_test_key"
DEFAULT_TIMEOUT = 300
ENVD_VERSION = "0.6.4"
CLIENT_ID = "e2b-test-client"

_ID_ALPHABET = string.ascii_lowercase + string.digits


@dataclass
class Fault:
    """An injected failure for the next matching API calls."""

    status: int
    message: str
    retry_after: int | None = None
    should_retry: bool | None = None
    times: int = 1

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.should_retry is not None:
            headers["Should-Retry"] = "true" if self.should_retry else "false"
        return headers


@dataclass
class RecordedRequest:
    """One HTTP request the server received (control plane or envd)."""

    plane: str  # "api", "envd" or "edge" (a sandbox port, by name)
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any = None
    sandbox_id: str | None = None
    status: int | None = None


@dataclass
class StartedCommand:
    """A process started through envd (per-command envs included, for secret checks)."""

    sandbox_id: str
    pid: int
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    user: str


@dataclass
class Sandbox:
    """One fake sandbox and its container."""

    sandbox_id: str
    template_id: str
    image: str
    access_token: str
    metadata: dict[str, str]
    env_vars: dict[str, str]
    allow_internet_access: bool | None
    network: dict[str, Any] | None
    started_at: float
    end_at: float
    cpu_count: int = 2
    memory_mb: int = 512
    state: str = "starting"  # starting -> running -> killing -> killed
    killed_reason: str | None = None
    container: SandboxContainer | None = None
    processes: dict[int, ManagedProcess] = field(default_factory=dict)
    #: Set when created with `network.allowPublicTraffic = false`: the edge then asks for it.
    traffic_access_token: str | None = None
    domain: str | None = None
    #: The container's address on its network (the edge's target), once looked up.
    address: str | None = None

    @property
    def alive(self) -> bool:
        """Counted against caps until its container is gone (being killed included)."""
        return self.state in ("starting", "running", "killing")

    def created_json(self, envd_version: str) -> dict[str, Any]:
        """The `Sandbox` model returned by create and connect."""
        return {
            "templateID": self.template_id,
            "sandboxID": self.sandbox_id,
            "clientID": CLIENT_ID,
            "envdVersion": envd_version,
            "envdAccessToken": self.access_token,
            "trafficAccessToken": self.traffic_access_token,
            "domain": self.domain,
        }

    def listed_json(self, envd_version: str) -> dict[str, Any]:
        """The `ListedSandbox` model."""
        return {
            "templateID": self.template_id,
            "sandboxID": self.sandbox_id,
            "clientID": CLIENT_ID,
            "startedAt": _iso(self.started_at),
            "endAt": _iso(self.end_at),
            "cpuCount": self.cpu_count,
            "memoryMB": self.memory_mb,
            "diskSizeMB": 1024,
            "state": "running",
            "envdVersion": envd_version,
            "metadata": dict(self.metadata),
        }

    def detail_json(self, envd_version: str) -> dict[str, Any]:
        """The `SandboxDetail` model."""
        detail = self.listed_json(envd_version)
        detail.update(envdAccessToken=self.access_token, domain=self.domain)
        if self.allow_internet_access is not None:
            detail["allowInternetAccess"] = self.allow_internet_access
        if self.network is not None:
            detail["network"] = self.network
        return detail


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def new_sandbox_id() -> str:
    """An id shaped like E2B's: 20 lowercase alphanumerics starting with a letter."""
    return "i" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(19))


class FakeE2BCloud:
    """Sandboxes as Docker containers, with the fault injection and counters tests need."""

    def __init__(
        self,
        *,
        api_key: str = DEFAULT_API_KEY,
        templates: Mapping[str, str] | None = None,
        default_user: str | None = None,
        max_concurrent: int | None = None,
        container_network: str | None = None,
        container_options: Mapping[str, Any] | None = None,
        envd_version: str = ENVD_VERSION,
        base_images: Mapping[str, str] | None = None,
        keep_images: bool = False,
    ) -> None:
        """Configure the cloud.

        templates: templateID -> local image (default: "base" -> orchestrator-base:bookworm).
        default_user: user for commands/files when the SDK names none (default: the image's
            USER, else root).
        max_concurrent: like an E2B plan's cap; creates beyond it get 429.
        container_network: Docker network for sandboxes with internet access (default bridge);
            sandboxes created without internet access get `--network none`.
        container_options: extra keyword arguments for `containers.run`.
        base_images: template builds' `fromImage` ref -> local image (there is no registry
            to pull from); a ref not listed is used as is if it exists locally.
        keep_images: leave the images built for templates in place on `shutdown()`.
        """
        self.api_key = api_key
        self.templates: dict[str, str] = dict(templates or {"base": DEFAULT_IMAGE})
        self.default_user = default_user
        self.max_concurrent = max_concurrent
        self.container_network = container_network
        self.container_options: dict[str, Any] = dict(container_options or {})
        self.envd_version = envd_version
        self.base_images: dict[str, str] = dict(base_images or {})
        self.keep_images = keep_images
        self.create_delay: float = 0.0
        """Extra seconds each create takes (to widen races in concurrency tests)."""

        self.instance_id = uuid.uuid4().hex[:12]
        #: Sandbox ports are reached as `<port>-<sandbox id>.<domain>` (edge.py); `.test` is
        #: reserved for testing (RFC 2606), so no real name is shadowed.
        self.domain = f"e2b-{self.instance_id}.test"
        self.resolver = Resolver()
        self.requests: list[RecordedRequest] = []
        self.commands: list[StartedCommand] = []
        self.max_alive = 0
        self._docker: docker.DockerClient | None = None
        self._lock = threading.RLock()
        self._sandboxes: dict[str, Sandbox] = {}
        self._faults: dict[str, deque[Fault]] = {}
        self._reaper_stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.template_builds = TemplateBuilds(self)
        """Templates built through the API (`POST /v3/templates` and its builds)."""

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def docker(self) -> docker.DockerClient:
        if self._docker is None:
            self._docker = docker_client()
        return self._docker

    def start_reaper(self) -> None:
        """Remove containers and images of dead test servers; start killing sandboxes at their
        timeout."""
        reap_orphans(self.docker)
        reap_orphan_images(self.docker)
        if self._reaper is None:
            self._reaper_stop.clear()
            self._reaper = threading.Thread(target=self._reap_loop, name="e2b-reaper", daemon=True)
            self._reaper.start()

    def shutdown(self) -> None:
        """Stop the reaper, kill every sandbox this cloud created, stop its template builds and
        remove the images they made (unless `keep_images`)."""
        self._reaper_stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
            self._reaper = None
        self._kill_all(self.alive_ids(), reason="shutdown", wait=True)
        self.resolver.stop()
        if self._docker is not None:
            for container in list_containers(self.docker, **{LABEL_INSTANCE: self.instance_id}):
                container.remove(force=True)
            self.template_builds.shutdown()

    def _reap_loop(self) -> None:
        while not self._reaper_stop.wait(0.1):
            now = time.time()
            with self._lock:
                expired = [
                    s.sandbox_id
                    for s in self._sandboxes.values()
                    if s.state == "running" and s.end_at <= now
                ]
            self._kill_all(expired, reason="timeout", wait=False)

    def _kill_all(self, sandbox_ids: list[str], reason: str, wait: bool) -> None:
        """Kill sandboxes in parallel (removing a container takes a while)."""
        threads = [
            threading.Thread(target=self.kill, args=(i, reason), name=f"e2b-kill-{i}", daemon=True)
            for i in sandbox_ids
        ]
        for thread in threads:
            thread.start()
        if wait:
            for thread in threads:
                thread.join(timeout=30)

    # -- fault injection and counters (the test API) -----------------------------------

    def fail_next(
        self,
        operation: str,
        status: int = 500,
        *,
        retry_after: int | None = None,
        should_retry: bool | None = None,
        times: int = 1,
        message: str | None = None,
    ) -> None:
        """Make the next `times` calls of `operation` fail with `status`.

        operation: "create", "list", "get", "kill", "set_timeout" or "connect"; for template
            builds "template_request" (POST /v3/templates), "template_files" (the upload
            link), "template_upload" (the PUT of the files), "template_build" (starting
            the build) or "template_status".
        """
        text = message or ("Rate limit exceeded" if status == 429 else f"injected error {status}")
        with self._lock:
            queue = self._faults.setdefault(operation, deque())
            queue.append(Fault(status, text, retry_after, should_retry, times))

    def fail_next_create(
        self,
        status: int = 429,
        retry_after: int | None = 1,
        times: int = 1,
        *,
        should_retry: bool | None = None,
        message: str | None = None,
    ) -> None:
        """Make the next `times` sandbox creations fail (429 with Retry-After by default).

        The SDK itself retries 429/502/503/504 (3 retries by default, honouring
        Retry-After), so to see the SDK's exception use times > retries or `retries=0`.
        """
        self.fail_next(
            "create",
            status,
            retry_after=retry_after,
            should_retry=should_retry,
            times=times,
            message=message,
        )

    def check_fault(self, operation: str) -> None:
        """Raise the pending injected fault for `operation`, if any."""
        with self._lock:
            queue = self._faults.get(operation)
            if not queue:
                return
            fault = queue[0]
            fault.times -= 1
            if fault.times <= 0:
                queue.popleft()
        raise ApiError(fault.status, fault.message, fault.headers())

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def alive_count(self) -> int:
        """Sandboxes alive right now (being created or running)."""
        with self._lock:
            return sum(1 for s in self._sandboxes.values() if s.alive)

    def alive_ids(self) -> list[str]:
        with self._lock:
            return [s.sandbox_id for s in self._sandboxes.values() if s.alive]

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """A sandbox by id, dead or alive (KeyError if never created)."""
        with self._lock:
            return self._sandboxes[sandbox_id]

    @property
    def create_requests(self) -> list[dict[str, Any]]:
        """The JSON bodies of every create request received, in order."""
        return [
            r.body
            for r in list(self.requests)
            if r.plane == "api" and r.method == "POST" and r.path in ("/sandboxes", "/v2/sandboxes")
        ]

    def reset(self) -> None:
        """Forget recorded requests, commands, faults and counters (sandboxes stay)."""
        with self._lock:
            self.requests.clear()
            self.commands.clear()
            self._faults.clear()
            self.max_alive = sum(1 for s in self._sandboxes.values() if s.alive)
            self.create_delay = 0.0

    @property
    def template_requests(self) -> list[dict[str, Any]]:
        """The JSON bodies of every template build request (`POST /v3/templates`)."""
        return [
            r.body
            for r in list(self.requests)
            if r.plane == "api" and r.method == "POST" and r.path == "/v3/templates"
        ]

    @property
    def template_build_requests(self) -> list[dict[str, Any]]:
        """The JSON bodies of every build start (`POST /v2/templates/{id}/builds/{build}`):
        fromImage, steps, startCmd, readyCmd, force."""
        return [
            r.body
            for r in list(self.requests)
            if r.plane == "api"
            and r.method == "POST"
            and r.path.startswith("/v2/templates/")
            and "/builds/" in r.path
        ]

    def template_build(self, build_id: str) -> TemplateBuild:
        """A template build by id: its status, logs, Dockerfile and image."""
        return self.template_builds.build(build_id)

    def reset_templates(self) -> None:
        """Forget templates built through the API (their names stop resolving), cancel
        running builds, drop uploaded files and remove the images built (unless
        `keep_images`). Kill the sandboxes using them first."""
        self.template_builds.reset()

    def kill_sandbox(self, sandbox_id: str) -> bool:
        """Simulate a sandbox vanishing: container killed, streams cut, later calls fail."""
        return self.kill(sandbox_id, reason="injected")

    def container_ids(self) -> list[str]:
        """Ids of this cloud's containers that still exist in Docker."""
        return [c.id for c in list_containers(self.docker, **{LABEL_INSTANCE: self.instance_id})]

    # -- control plane -----------------------------------------------------------------

    def create(self, body: Mapping[str, Any]) -> Sandbox:
        """Create a sandbox from a `NewSandbox` body; raises ApiError."""
        self.check_fault("create")
        template_id = str(body.get("templateID") or "")
        image = self.templates.get(template_id)
        if image is None:
            raise ApiError(404, f"template '{template_id}' not found")
        runtime = self.template_builds.runtime(image)
        options = dict(self.container_options)
        if runtime is not None:  # a template built here: its id, resources, start command
            template_id = runtime.template_id
            if runtime.cpu_count:
                options.setdefault("nano_cpus", min(runtime.cpu_count, os.cpu_count() or 1) * 10**9)
            if runtime.memory_mb:
                options.setdefault("mem_limit", f"{runtime.memory_mb}m")
        timeout = int(body.get("timeout", DEFAULT_TIMEOUT))
        network = body.get("network")
        allow_internet = body.get("allow_internet_access")
        network_mode = self._network_mode(
            allow_internet, dict(network) if isinstance(network, Mapping) else None
        )
        if network_mode != "none":  # it resolves other sandboxes' port names, as on E2B
            options.setdefault("dns", [self.resolver_address()])  # (started once, before
        now = time.time()  # the sandbox's clock starts)
        sandbox = Sandbox(
            sandbox_id=new_sandbox_id(),
            template_id=template_id,
            image=image,
            access_token=secrets.token_urlsafe(24),
            metadata={str(k): str(v) for k, v in (body.get("metadata") or {}).items()},
            env_vars={str(k): str(v) for k, v in (body.get("envVars") or {}).items()},
            allow_internet_access=allow_internet,
            network=dict(network) if isinstance(network, Mapping) else None,
            started_at=now,
            end_at=now + timeout,
            domain=self.domain,
        )
        if isinstance(network, Mapping) and network.get("allowPublicTraffic") is False:
            sandbox.traffic_access_token = secrets.token_urlsafe(24)
        if runtime is not None:
            sandbox.cpu_count = runtime.cpu_count or sandbox.cpu_count
            sandbox.memory_mb = runtime.memory_mb or sandbox.memory_mb
        with self._lock:
            alive = sum(1 for s in self._sandboxes.values() if s.alive)
            if self.max_concurrent is not None and alive >= self.max_concurrent:
                raise ApiError(
                    429,
                    "You have reached the maximum number of concurrent E2B sandboxes "
                    f"({self.max_concurrent}).",
                )
            self._sandboxes[sandbox.sandbox_id] = sandbox
            self.max_alive = max(self.max_alive, alive + 1)
        try:
            if self.create_delay:
                time.sleep(self.create_delay)
            sandbox.container = SandboxContainer.start(
                self.docker,
                image=image,
                name=f"e2b-test-{sandbox.sandbox_id}",
                labels={
                    LABEL: "1",
                    LABEL_SANDBOX: sandbox.sandbox_id,
                    LABEL_INSTANCE: self.instance_id,
                    LABEL_OWNER_PID: str(os.getpid()),
                },
                network_mode=network_mode,
                options=options,
            )
            if runtime is not None and (runtime.start_cmd or runtime.ready_cmd):
                try:
                    run_start_command(sandbox.container, runtime.start_cmd, runtime.ready_cmd)
                except BaseException:
                    sandbox.container.remove()
                    raise
        except Exception as e:
            with self._lock:
                sandbox.state = "killed"
                sandbox.killed_reason = "create failed"
            raise ApiError(500, f"failed to start sandbox: {e}") from e
        with self._lock:
            if sandbox.state == "starting":
                sandbox.state = "running"
                sandbox.end_at = time.time() + timeout
                return sandbox
        try:  # killed while starting
            sandbox.container.remove()
        finally:
            with self._lock:
                sandbox.state = "killed"
        raise ApiError(500, "sandbox was killed while starting")

    def _network_mode(self, allow_internet: Any, network: dict[str, Any] | None) -> str | None:
        deny_all = allow_internet is False or (
            network is not None
            and "0.0.0.0/0" in (network.get("denyOut") or [])
            and not network.get("allowOut")
        )
        return "none" if deny_all else self.container_network

    def edge_address(self) -> str:
        """This host's address on the sandboxes' network, where the edge listens for them."""
        return network_gateway(self.docker, self.container_network)

    def resolver_address(self) -> str:
        """The DNS resolver's address (started at the first sandbox that needs it)."""
        with self._lock:
            return self.resolver.start(
                self.docker,
                image=self.templates.get("base", DEFAULT_IMAGE),
                network=self.container_network,
                domain=self.domain,
                edge=self.edge_address(),
                labels={
                    LABEL: "1",
                    LABEL_INSTANCE: self.instance_id,
                    LABEL_OWNER_PID: str(os.getpid()),
                },
            )

    def container_address(self, sandbox: Sandbox) -> str | None:
        """The sandbox container's address on its network (None without one)."""
        if sandbox.address is None and sandbox.container is not None:
            try:
                info = self.docker.api.inspect_container(sandbox.container.id)
            except docker.errors.APIError:
                return None
            networks = info["NetworkSettings"]["Networks"] or {}
            found = [n["IPAddress"] for n in networks.values() if n.get("IPAddress")]
            sandbox.address = found[0] if found else None
        return sandbox.address

    def running(self, sandbox_id: str) -> Sandbox | None:
        """The sandbox if it is running, else None."""
        with self._lock:
            sandbox = self._sandboxes.get(sandbox_id)
            return sandbox if sandbox is not None and sandbox.state == "running" else None

    def get(self, sandbox_id: str) -> Sandbox:
        self.check_fault("get")
        sandbox = self.running(sandbox_id)
        if sandbox is None:
            raise ApiError(404, f"sandbox \"{sandbox_id}\" doesn't exist or you don't have access")
        return sandbox

    def list_running(self, metadata: Mapping[str, str], states: list[str]) -> list[Sandbox]:
        """Running sandboxes whose metadata contains every pair in `metadata`."""
        self.check_fault("list")
        if states and "running" not in states:
            return []
        with self._lock:
            found = [s for s in self._sandboxes.values() if s.state == "running"]
        return sorted(
            (s for s in found if all(s.metadata.get(k) == v for k, v in metadata.items())),
            key=lambda s: s.started_at,
        )

    def set_timeout(self, sandbox_id: str, timeout: int) -> None:
        self.check_fault("set_timeout")
        sandbox = self.get(sandbox_id)
        with self._lock:
            sandbox.end_at = time.time() + timeout

    def connect(self, sandbox_id: str, timeout: int | None) -> Sandbox:
        """Connect to a running sandbox, extending (never shortening) its timeout."""
        self.check_fault("connect")
        sandbox = self.get(sandbox_id)
        if timeout is not None:
            with self._lock:
                sandbox.end_at = max(sandbox.end_at, time.time() + timeout)
        return sandbox

    def delete(self, sandbox_id: str) -> None:
        self.check_fault("kill")
        if not self.kill(sandbox_id, reason="api"):
            raise ApiError(404, f'sandbox "{sandbox_id}" not found')

    def kill(self, sandbox_id: str, reason: str) -> bool:
        """Stop serving the sandbox, then remove its container. False if it was not alive.

        It stays counted as alive until the container is gone.
        """
        with self._lock:
            sandbox = self._sandboxes.get(sandbox_id)
            if sandbox is None or sandbox.state not in ("starting", "running"):
                return False
            starting = sandbox.state == "starting"
            sandbox.state = "killing"
            sandbox.killed_reason = reason
            container = sandbox.container
        if starting or container is None:
            return True  # create() removes the container as soon as it exists
        try:
            container.remove()
        finally:
            with self._lock:
                sandbox.state = "killed"
        return True

    # -- envd helpers ------------------------------------------------------------------

    def resolve_user(self, sandbox: Sandbox, name: str | None) -> UserInfo:
        """The named user, else the default one; KeyError if unknown."""
        assert sandbox.container is not None
        user = name or self.default_user or sandbox.container.image_user or "root"
        return sandbox.container.user_info(user)

    def register_process(self, sandbox: Sandbox, process: ManagedProcess) -> None:
        with self._lock:
            sandbox.processes[process.pid] = process

    def processes(self, sandbox: Sandbox) -> list[ManagedProcess]:
        """A snapshot of the sandbox's running processes."""
        with self._lock:
            return list(sandbox.processes.values())

    def unregister_process(self, sandbox: Sandbox, process: ManagedProcess) -> None:
        with self._lock:
            if sandbox.processes.get(process.pid) is process:
                del sandbox.processes[process.pid]

    def is_running(self, sandbox: Sandbox) -> bool:
        with self._lock:
            return sandbox.state == "running"


__all__ = [
    "ApiError",
    "ContainerGone",
    "DEFAULT_API_KEY",
    "DEFAULT_IMAGE",
    "FakeE2BCloud",
    "Fault",
    "RecordedRequest",
    "Sandbox",
    "StartedCommand",
]
