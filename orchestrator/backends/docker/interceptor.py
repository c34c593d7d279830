"""The secret interceptor's output read back on the host (images/interceptor/interceptor.py):
where it listens and the run's CA certificate, the values it put on the wire and the
requests it refused, as squid's access log is read back in egress.py.

Its image (`ensure_interceptor_image`: mitmproxy 12 on Debian trixie's Python 3.13, built
offline from a wheelhouse, hardened as the agent image) and its container (`Interceptor`:
hardened as the gateway's, the configuration with the values on its attached stdin) are
here too. A run with bound secrets gets one on its private network, in front of its squid
(backend.py): the sandbox's proxy variables name the interceptor, the interceptor's upstream
is squid, so the allowlist applies to whatever it lets through.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import ImageBuildError
from ...images.imagedef import RUNTIME_DIR, Progress, digest, sha256
from ...images.wheelhouse import ensure_wheelhouse
from ...paths import VERSION, data_root
from ..base import SandboxSpec, SecretsProxyHandle
from .base_image import debian_base, resolve_base
from .deadline import kept
from .egress import Egress
from .engine import attached_lines, inspect_image, remove_attached, stopped
from .helper import (
    HelperError,
    HelperImagePlan,
    HelperLimits,
    create_helper,
    ensure_helper_image,
    start_attached,
)
from .images import python_target

if TYPE_CHECKING:
    import docker

    from ...payloads.binding import BoundSecret

INTERCEPTOR_IMAGE = "orchestrator-interceptor"
INTERCEPTOR_IMAGE_DIR = data_root() / "images" / "interceptor"
#: The `orchestrator.kind` labels: the image (set by its Dockerfile) and its containers.
KIND_INTERCEPTOR_IMAGE = "interceptor-image"
KIND_INTERCEPTOR = "interceptor"
#: Its base: mitmproxy 12 needs Python 3.12+. Pulled where a registry answers (3.13 on
#: Debian trixie), else Debian trixie made with debootstrap (Python 3.13 too): no registry,
#: no Python built by us. `$ORCHESTRATOR_BASE_IMAGE` (the agent's, maybe 3.11) never applies.
INTERCEPTOR_BASE = "python:3.13-slim"
INTERCEPTOR_SUITE = "trixie"
#: Where the image has the keeper, the interceptor and mitmproxy's interpreter.
INTERCEPTOR_KEEPER = ("python3", "/opt/interceptor/deadline.py")
INTERCEPTOR_COMMAND = ["/opt/venv/bin/python", "-I", "/opt/interceptor/interceptor.py"]
#: The interceptor's port on the run's network, and where mitmproxy makes the run's CA (a
#: tmpfs: the CA's key never touches a disk, an image or the container's configuration).
INTERCEPTOR_PORT = 3129
CONFDIR = "/tmp/interceptor"
#: Its limits: it relays, but decrypts and encrypts every byte.
INTERCEPTOR_LIMITS = HelperLimits(memory="256m", pids=64, cpus=1.0)
INTERCEPTOR_USER = "10001:10001"
READY_TIMEOUT = 30.0
MAX_LINE = 64 * 1024
#: What the host keeps of its decisions: the refusals (each an `egress_blocked` event), the
#: distinct secret, host and place injections, and its last lines (diagnostics).
MAX_ATTEMPTS = 10_000
MAX_INJECTIONS = 1_000
RECENT_LINES = 200

#: The prefixes of the interceptor's lines (its module docstring describes them).
READY_PREFIX = "ORCH-INTERCEPTOR-READY\t"
LOG_PREFIX = "ORCH-SECRET\t"
#: The reason of a request refused because it carried a placeholder where its secret may
#: not go (the `egress_blocked` event's `reason`).
SECRET_NOT_BOUND = "secret_not_bound"
#: Why a client's TLS handshake with the interceptor failed, as the record says it.
TLS_REFUSED = (
    "the client refused the interception's certificate (it pins certificates, or trusts "
    "only its own CA store, not the run's CA)"
)
#: Why the interceptor would not connect a client to its server, as the record says it.
UPSTREAM_TLS = (
    "TLS failure upstream: the server's certificate did not verify (the interceptor checks "
    "it against the public CAs), or its TLS failed"
)


@dataclass(frozen=True)
class Ready:
    """The interceptor listens at `address` (host:port); the sandbox must trust `ca_pem`."""

    address: str
    ca_pem: str


def read_ready(text: str) -> Ready | None:
    """The interceptor's ready line in its output, or None while it has none (a line that
    does not read as one is no ready line: the caller keeps waiting, then fails)."""
    for line in text.splitlines():
        if not line.startswith(READY_PREFIX):
            continue
        parts = line[len(READY_PREFIX) :].split("\t")
        if len(parts) != 2:
            continue
        try:
            pem = base64.b64decode(parts[1], validate=True).decode("ascii")
        except (binascii.Error, UnicodeDecodeError):
            continue
        if pem.startswith("-----BEGIN CERTIFICATE-----") and "PRIVATE KEY" not in pem:
            return Ready(parts[0], pem)
    return None


def _records(text: str) -> list[dict[str, Any]]:
    records = []
    for line in text.splitlines():
        if not line.startswith(LOG_PREFIX):
            continue
        try:
            record = json.loads(line[len(LOG_PREFIX) :])
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("ts"), (int, float)):
            records.append(record)
    return records


def refusals(text: str) -> list[dict[str, Any]]:
    """What the interceptor refused, as egress attempts (the shape of
    `egress.parse_access_log`'s): a placeholder where its secret may not go (`denied`,
    reason `secret_not_bound`, with the secret's name, the place and why), clients that
    refused its certificate (`allowed` but failed: pinning, their own CA store), and servers
    whose certificate did not verify (`allowed` but failed)."""
    attempts = []
    for record in _records(text):
        verdict = record.get("verdict")
        event: dict[str, Any] = {"ts": float(record["ts"]), "host": record.get("host")}
        if verdict == "refused":
            event.update(
                method=record.get("method"),
                verdict="denied",
                reason=SECRET_NOT_BOUND,
                secret=record.get("name"),
                place=record.get("place"),
                detail=record.get("why"),
            )
        elif verdict == "tls_failed":
            event.update(verdict="allowed", reason=TLS_REFUSED, detail=record.get("why"))
        elif verdict == "upstream_tls_failed":
            event.update(verdict="allowed", reason=UPSTREAM_TLS, detail=record.get("why"))
        else:
            continue
        attempts.append(event)
    return attempts


def injections(text: str) -> list[dict[str, Any]]:
    """Where each secret's value was put on the wire, one entry per secret, host and place,
    in the order first seen: `{"secret", "host", "place", "count", "first_ts"}`; the record
    shows `injected NAME HOST PLACE`. Never a value: the interceptor never writes one."""
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for record in _records(text):
        if record.get("verdict") != "injected":
            continue
        key = (str(record.get("name")), str(record.get("host")), str(record.get("place")))
        entry = seen.setdefault(
            key,
            {
                "secret": key[0],
                "host": key[1],
                "place": key[2],
                "count": 0,
                "first_ts": record["ts"],
            },
        )
        entry["count"] += 1
    return list(seen.values())


class InterceptorError(HelperError):
    """The secret interceptor could not be started (a run never starts without it)."""


def plan_interceptor_image(
    client: docker.DockerClient, *, progress: Progress | None = None, make_base: bool = True
) -> HelperImagePlan | None:
    """The image's tag, hashed over its files (the definition, the addon, the runtime's
    masking and keeper, the agent image's hardening), the base's id, the wheels and the
    version; builds nothing. None when its base is missing and `make_base` is False (what
    `images prune` asks: no pull and no debootstrap to learn what to keep)."""
    if make_base:
        base = resolve_base(client, INTERCEPTOR_BASE, progress, suite=INTERCEPTOR_SUITE)
    else:
        present = (INTERCEPTOR_BASE, debian_base(INTERCEPTOR_SUITE))
        base = next((b for b in present if inspect_image(client, b) is not None), "")
        if not base:
            return None
    base_id = client.api.inspect_image(base)["Id"]
    target = python_target(client, base)
    if tuple(int(n) for n in target.version.split(".")[:2]) < (3, 12):
        raise ImageBuildError(
            f"The interceptor's base {base} has Python {target.version}; mitmproxy 12 needs "
            "3.12 or newer.",
            f"Remove {base} (`docker rmi {base}`): it is then pulled or made again.",
        )
    requirements = (INTERCEPTOR_IMAGE_DIR / "requirements.txt").read_text()
    wheelhouse = ensure_wheelhouse(requirements, target, progress=progress)
    files = {
        name: (INTERCEPTOR_IMAGE_DIR / name).read_bytes()
        for name in ("Dockerfile", "interceptor.py", "requirements.txt")
    }
    files["masking.py"] = (RUNTIME_DIR / "masking.py").read_bytes()
    files["deadline.py"] = (RUNTIME_DIR / "deadline.py").read_bytes()
    files["harden.sh"] = (data_root() / "images" / "agent" / "harden.sh").read_bytes()
    content_hash = digest(
        {
            "version": VERSION,
            "base_id": base_id,
            "files": {name: sha256(data) for name, data in files.items()},
            "wheels": wheelhouse.wheels,
        }
    )
    tag = f"{INTERCEPTOR_IMAGE}:{content_hash[:12]}"
    wheels = wheelhouse.context_files()
    return HelperImagePlan(tag, content_hash, base, base_id, files, target.version, wheels)


def ensure_interceptor_image(client: docker.DockerClient, progress: Progress | None = None) -> str:
    """The tag of the interceptor image, built once (offline, from the wheelhouse) when
    missing; its base is made once per host too. Unchanged inputs: hashing and inspections."""
    plan = plan_interceptor_image(client, progress=progress)
    assert plan is not None  # make_base: the base is there now
    return ensure_helper_image(client, plan, "mitmproxy", progress)


@dataclass(frozen=True)
class InterceptorRoute:
    """Where the interceptor sends what it lets through instead of the run's squid, and the
    CA it then trusts upstream (PEM): a stand-in on this host for tests, whose HTTPS server
    has names no resolver knows (`DockerBackend(interceptor_route=...)`, never a setting).
    The interceptor is then on the default bridge too, to reach it."""

    proxy: str
    ca_pem: str


class Interceptor(SecretsProxyHandle):
    """One run's interceptor container: hardened as the model gateway's (runc and our
    seccomp profile, read-only root, every capability dropped, no engine-side log, the
    keeper as PID 1), its configuration, the secrets' values included, only on its attached
    stdin; its decisions read live from its stdout, kept bounded (`MAX_ATTEMPTS`,
    `MAX_INJECTIONS`: a sandbox that makes a million refused requests costs the host no
    more than that)."""

    def __init__(self, client: docker.DockerClient, container_id: str, network_name: str):
        self.client = client
        self.container_id = container_id
        self.network_name = network_name
        self.ip: str | None = None
        #: Where what it lets through goes (the run's squid), and an extra upstream CA.
        self.upstream: str | None = None
        self.upstream_ca_pem: str | None = None
        self._socket: Any = None
        self._ready: Ready | None = None
        self._recent: deque[str] = deque(maxlen=RECENT_LINES)
        self._attempts: list[dict[str, Any]] = []
        self._injected: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._stderr: deque[str] = deque(maxlen=20)
        self._listening = threading.Event()  # its ready line has arrived
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls,
        client: docker.DockerClient,
        *,
        run_id: str,
        network_name: str,
        labels: dict[str, str],
        image: str,
        stop_at: float,
        outbound: bool = False,
    ) -> Interceptor:
        """Create and start the container on `network_name` (`outbound`: on the default
        bridge too, for an `InterceptorRoute`); it then waits for its configuration
        (`configure`, `open`). Removes the container again on failure."""
        api = client.api
        container_id = create_helper(
            api,
            kind=KIND_INTERCEPTOR,
            run_id=run_id,
            image=image,
            entrypoint=kept(INTERCEPTOR_KEEPER, stop_at, INTERCEPTOR_COMMAND),
            labels=labels,
            network_mode="bridge" if outbound else network_name,
            limits=INTERCEPTOR_LIMITS,
            user=INTERCEPTOR_USER,  # /tmp, memory only, holds the run's CA
        )
        interceptor = cls(client, container_id, network_name)
        try:
            if outbound:
                api.connect_container_to_network(container_id, network_name)
            interceptor._socket, interceptor.ip = start_attached(api, container_id, network_name)
            reader = threading.Thread(target=interceptor._read, name="interceptor-output")
            reader.daemon = True
            reader.start()
        except BaseException:
            interceptor.remove()
            raise
        return interceptor

    @classmethod
    def for_run(
        cls,
        client: docker.DockerClient,
        spec: SandboxSpec,
        egress: Egress,
        image: str,
        stop_at: float,
        route: InterceptorRoute | None = None,
    ) -> Interceptor:
        """The run's interceptor on its network, in front of its squid (the upstream: the
        allowlist applies to what it lets through), with the run's labels and deadline; it
        waits for the bound secrets (`open`, at the run's start). `route`: tests only."""
        interceptor = cls.start(
            client,
            run_id=spec.run_id,
            network_name=egress.network_name,
            labels=spec.labels,
            image=image,
            stop_at=stop_at,
            outbound=route is not None,
        )
        interceptor.upstream = route.proxy if route else egress.proxy_url
        interceptor.upstream_ca_pem = route.ca_pem if route else None
        return interceptor

    @property
    def proxy_url(self) -> str:
        """What the sandbox's proxy variables name: this interceptor on the run's network."""
        return f"http://{self.ip}:{INTERCEPTOR_PORT}"

    def open(self, bound: tuple[BoundSecret, ...], passthrough: tuple[str, ...] = ()) -> str:
        """The run's bound secrets (values included) on its stdin, with its upstream (the
        run's squid: the allowlist still applies to what it lets through) and the hosts
        whose TLS it relays unread (`passthrough`); returns the run's CA certificate once it
        listens. Raises InterceptorError when it will not."""
        config: dict[str, Any] = {
            "bindings": [b.interceptor_config() for b in bound],
            "upstream_proxy": self.upstream,
            "passthrough": list(passthrough),
        }
        if self.upstream_ca_pem:
            config["upstream_ca_pem"] = self.upstream_ca_pem
        self.configure(config)
        return self.wait_ready().ca_pem

    def configure(self, config: dict[str, Any]) -> None:
        """Hand it its configuration (the bindings with their values; see interceptor.py's
        docstring) on its stdin; where it listens and its confdir are this class's."""
        line = {**config, "listen": ["0.0.0.0", INTERCEPTOR_PORT], "confdir": CONFDIR}
        self._socket._sock.sendall(json.dumps(line).encode() + b"\n")

    def wait_ready(self) -> Ready:
        """Where it listens (on the run's network) and the run's CA certificate; raises
        InterceptorError with its last words if it will not listen."""
        deadline = time.monotonic() + READY_TIMEOUT
        while not self._listening.wait(timeout=0.02):
            if self.alive() is not None or time.monotonic() > deadline:
                break
        ready = self._ready
        if ready is None:
            raise InterceptorError(
                "The secret interceptor did not start. Its last output:\n"
                + ("\n".join(self._stderr) or "(none)"),
                "Rebuild its image (`orchestrator images prune`, then run again).",
            )
        port = ready.address.rpartition(":")[2]
        return Ready(f"{self.ip}:{port}", ready.ca_pem)

    def output(self) -> str:
        """Its last `RECENT_LINES` lines on stdout (for diagnostics and tests: `refusals`
        and `injections` read such text)."""
        with self._lock:
            return "".join(self._recent)

    def attempts(self) -> list[dict[str, Any]]:
        """What it refused so far, in order, as `refusals` reads them (the first
        `MAX_ATTEMPTS`); the list only grows."""
        with self._lock:
            return list(self._attempts)

    def injections(self) -> list[dict[str, Any]]:
        """Where each secret's value went so far (as `injections` reads them; at most
        `MAX_INJECTIONS` secret, host and place entries)."""
        with self._lock:
            return [dict(entry) for entry in self._injected.values()]

    def _read(self) -> None:
        for stream_id, raw in attached_lines(self._socket, MAX_LINE):
            text = raw.decode("utf-8", "replace")
            if stream_id == 1:
                self._line(text)
            elif text.strip():
                self._stderr.append(text.strip())

    def _line(self, text: str) -> None:
        """One stdout line: the ready line, or a decision folded into the bounded state."""
        if self._ready is None and text.startswith(READY_PREFIX):
            self._ready = read_ready(text)
            if self._ready is not None:
                self._listening.set()
            return
        with self._lock:
            self._recent.append(text + "\n")
            if len(self._attempts) < MAX_ATTEMPTS:
                self._attempts += refusals(text)
            for entry in injections(text):
                key = (entry["secret"], entry["host"], entry["place"])
                if key in self._injected:
                    self._injected[key]["count"] += entry["count"]
                elif len(self._injected) < MAX_INJECTIONS:
                    self._injected[key] = entry

    def alive(self) -> str | None:
        """None while it runs; else why the run has lost its way out."""
        return stopped(
            self.client,
            self.container_id,
            "secret interceptor",
            "the sandbox had no way out from then on",
        )

    def remove(self) -> None:
        """Remove the container; idempotent."""
        remove_attached(self.client, self.container_id, self._socket)
