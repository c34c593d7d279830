"""Per-run egress control for Docker: a private network and a squid proxy as its only way out.

An `allowlist` run gets:

- a network of its own, `internal` (no route out) and with no address for the host on its
  bridge (`inhibit_ipv4`), so neither the internet nor the Docker host's services nor other
  runs are reachable from it;
- an egress container (squid, built from `images/egress/`) on that network and on the default
  bridge, allowing only the run's hosts (and a named model endpoint on the Docker host);
- a sandbox on that network only, with no DNS resolver that answers outside names, and the
  standard proxy variables pointing at squid.

If squid dies, the sandbox has no route anywhere (fail closed); the runner notices through
`alive()` and ends the run. What squid refused is read back from its access log.

Which hosts are allowed is decided backend-neutrally in `orchestrator/policy.py`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from ...images.imagedef import RUNTIME_DIR, Progress, digest, sha256
from ...labels import LABEL_KIND
from ...paths import VERSION, data_root
from ...policy import HOST_ALIAS, describe_allowlist, host_networks, hosts_line
from ...spec import NetworkPolicy
from .base_image import resolve_base
from .deadline import EGRESS_KEEPER, kept
from .engine import stopped
from .helper import (
    HelperError,
    HelperImagePlan,
    HelperLimits,
    container_ip,
    create_helper,
    ensure_helper_image,
)

if TYPE_CHECKING:
    import docker

EGRESS_IMAGE = "orchestrator-egress"


EGRESS_IMAGE_DIR = data_root() / "images" / "egress"


#: Values of the `orchestrator.kind` label.
KIND_EGRESS = "egress"


KIND_EGRESS_NETWORK = "egress-network"
KIND_EGRESS_IMAGE = "egress-image"  # set by images/egress/Dockerfile


#: squid's port on the run's network (see images/egress/squid.conf.template).
PROXY_PORT = 3128


#: How long squid may take to start listening.
READY_TIMEOUT = 20.0

#: How long squid may take to stop before its last log is read, where the log could not be
#: flushed (`Egress.flush`; its `shutdown_lifetime` is 0, yet its shutdown takes ~2 s).
STOP_TIMEOUT = 5
#: Under this name, the host of the marker request `Egress.flush` makes squid refuse and
#: log (a random label first): a name no allowlist can hold (`.invalid` never resolves, and
#: squid never resolves an unlisted name), left out of what the host reads
#: (`parse_access_log`).
FLUSH_HOST = "orchestrator-log-flush.invalid"
#: How long the marker may take to show in the engine's copy of squid's log (then squid is
#: stopped instead).
FLUSH_TIMEOUT = 5.0
#: What runs in the egress container to ask squid for the marker (argv[1]: the request).
FLUSH_PROBE = (
    "import socket, sys\n"
    f"s = socket.create_connection(('127.0.0.1', {PROXY_PORT}), 5)\n"
    "s.sendall(sys.argv[1].encode())\n"
    "while s.recv(65536): pass\n"
)


#: The squid egress container's limits: small, it only relays.
EGRESS_LIMITS = HelperLimits(memory="256m", pids=64, cpus=0.5)


NETWORK_OPTIONS = {"com.docker.network.bridge.inhibit_ipv4": "true"}


#: What the keeper runs in the egress container: render squid's configuration, become squid.
EGRESS_COMMAND = ["python3", "-I", "-S", "/etc/squid/orchestrator/entrypoint.py"]
#: The keeper, shipped into the egress image from the runtime package (the same file).
KEEPER_SOURCE = RUNTIME_DIR / "deadline.py"
SQUID_DIRS = ("/tmp", "/var/run/squid", "/var/spool/squid", "/var/log/squid")


class EgressError(HelperError):
    """The egress proxy could not be started (the run never starts without it)."""


def plan_egress_image(
    client: docker.DockerClient, *, base: str | None = None, progress: Progress | None = None
) -> HelperImagePlan:
    """The egress image's tag, content-addressed like the agent image (its definition files,
    the keeper, the base image id and the version); builds nothing."""
    base = resolve_base(client, base, progress)
    base_id = client.api.inspect_image(base)["Id"]
    files = {
        path.name: path.read_bytes()
        for path in sorted(EGRESS_IMAGE_DIR.iterdir())
        if path.is_file() and path.suffix != ".pyc"
    }
    files["deadline.py"] = KEEPER_SOURCE.read_bytes()
    content_hash = digest(
        {
            "version": VERSION,
            "base_id": base_id,
            "files": {name: sha256(data) for name, data in files.items()},
        }
    )
    tag = f"{EGRESS_IMAGE}:{content_hash[:12]}"
    return HelperImagePlan(tag, content_hash, base, base_id, files)


def ensure_egress_image(
    client: docker.DockerClient, *, base: str | None = None, progress: Progress | None = None
) -> str:
    """The tag of the egress image, built on demand (see `plan_egress_image`)."""
    plan = plan_egress_image(client, base=base, progress=progress)
    return ensure_helper_image(client, plan, "squid", progress)


@dataclass
class Egress:
    """The private network and the egress container of one run."""

    client: docker.DockerClient
    network_id: str
    network_name: str
    container_id: str | None = None
    proxy_ip: str | None = None

    @classmethod
    def start(
        cls,
        client: docker.DockerClient,
        *,
        run_id: str,
        labels: dict[str, str],
    ) -> Egress:
        """Create the run's private network, with no way out at all until `start_proxy` puts
        squid on it (a run whose only destination is its model gateway never does). Raises
        EgressError when the engine cannot create it."""
        import docker.errors

        try:
            network = client.api.create_network(
                f"orchestrator-net-{run_id}",
                driver="bridge",
                internal=True,
                options=NETWORK_OPTIONS,
                labels={**labels, LABEL_KIND: KIND_EGRESS_NETWORK},
                check_duplicate=True,
            )
        except docker.errors.APIError as exc:
            raise EgressError(
                f"Cannot create the run's private network: {exc.explanation or exc}",
                "Every allowlist run needs its own network, and Docker's default address pools "
                "hold about 30: remove leftovers (`orchestrator cleanup`, `docker network "
                "prune`), run fewer at once, or give the engine smaller subnets "
                '(`"default-address-pools"` in daemon.json, e.g. size 24).',
            ) from exc
        return cls(client, network["Id"], f"orchestrator-net-{run_id}")

    def subnets(self) -> list[str]:
        """The run's network's address ranges (its only clients)."""
        config = self.client.api.inspect_network(self.network_id)["IPAM"]["Config"]
        return [c["Subnet"] for c in config]

    def start_proxy(
        self,
        run_id: str,
        policy: NetworkPolicy,
        labels: dict[str, str],
        image: str,
        stop_at: float,
        progress: Progress | None = None,
    ) -> None:
        """Start squid on the network, its policy on its stdin (`start_with_policy`); on failure
        `remove` removes what was made. Does not wait for squid to listen: call `wait_ready`
        before the sandbox makes its first request (the sandbox's own start overlaps
        squid's). Raises the engine's errors."""
        if progress is not None:
            progress(f"egress proxy for {hosts_line(describe_allowlist(policy)) or 'nothing'}")
        api = self.client.api
        subnets = self.subnets()
        config = {
            "hosts": [h for h in policy.hosts if not h.startswith("*.")],
            "wildcards": [h[2:] for h in policy.hosts if h.startswith("*.")],
            "endpoints": [list(e) for e in policy.endpoints],
            "host_endpoints": [list(e) for e in policy.host_endpoints],
            "clients": subnets,
            "blocked_dst": self._blocked_destinations(),
        }
        self.container_id = create_helper(
            api,
            kind=KIND_EGRESS,
            run_id=run_id,
            image=image,
            entrypoint=kept(EGRESS_KEEPER, stop_at, EGRESS_COMMAND),
            labels=labels,
            network_mode="bridge",  # outbound; the run's network is connected below
            limits=EGRESS_LIMITS,
            scratch=SQUID_DIRS,  # squid runs as `proxy`
            extra_hosts={HOST_ALIAS: "host-gateway"} if policy.host_endpoints else None,
            # its access log is read back (`blocked`): kept, and bounded
            log_config={"Type": "json-file", "Config": {"max-size": "20m", "max-file": "1"}},
        )
        api.connect_container_to_network(self.container_id, self.network_id)
        start_with_policy(api, self.container_id, config)
        self.proxy_ip = container_ip(api, self.container_id, self.network_name)

    def _blocked_destinations(self) -> list[str]:
        """Addresses no allowed name may resolve to beyond squid's fixed private ranges: the
        Docker host's own addresses and every Docker network's subnet."""
        blocked = {str(n) for n in host_networks()}
        for network in self.client.api.networks():
            for config in (network.get("IPAM") or {}).get("Config") or []:
                if config.get("Subnet"):
                    blocked.add(config["Subnet"])
        return sorted(blocked)

    def wait_ready(self) -> None:
        """Until squid accepts connections on both its ports, or fail with its log."""
        if self.container_id is None:
            return
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            log = self.client.api.logs(self.container_id, stdout=False, stderr=True)
            if log.count(b"Accepting ") >= 2:
                return
            state = self.client.api.inspect_container(self.container_id)["State"]
            if not state.get("Running") or time.monotonic() > deadline:
                tail = log.decode("utf-8", "replace").strip().splitlines()[-15:]
                raise EgressError(
                    "The egress proxy (squid) did not start "
                    f"({'it exited' if not state.get('Running') else 'timed out'}). "
                    "Its log:\n" + "\n".join(tail),
                    "Rebuild the egress image (`orchestrator images prune`, then run again), "
                    "or run with --network none.",
                )
            time.sleep(0.05)

    def proxy_env(self, direct: tuple[str, ...] = (), via: str | None = None) -> dict[str, str]:
        """The standard proxy variables for the sandbox (not secret); `direct` names
        addresses on the run's network reached without the proxy (the model gateway); `via`:
        the proxy the sandbox uses in squid's place (the secret interceptor, whose upstream
        squid is)."""
        if self.container_id is None:
            return {}
        url = via or f"http://{self.proxy_ip}:{PROXY_PORT}"
        env = {}
        for name in ("HTTP_PROXY", "HTTPS_PROXY"):
            env[name] = env[name.lower()] = url
        env["NO_PROXY"] = env["no_proxy"] = ",".join(("localhost", "127.0.0.1", *direct))
        return env

    @property
    def proxy_url(self) -> str | None:
        """squid's address on the run's network (None: no squid)."""
        return f"http://{self.proxy_ip}:{PROXY_PORT}" if self.container_id else None

    def alive(self) -> str | None:
        """None while squid runs; else why the sandbox has lost its network."""
        if self.container_id is None:
            return None
        return stopped(
            self.client,
            self.container_id,
            "egress proxy",
            "the sandbox had no network from then on",
        )

    def blocked(self, *, final: bool = False) -> list[dict[str, Any]]:
        """What squid refused or could not forward, from its access log (`parse_access_log`):
        host, port, method, time, verdict, reason. `final`: the run's last look, once its
        sandbox has ended: the log is flushed first (`flush`; squid stopped where it cannot
        be), so that nothing the sandbox tried is missing."""
        import docker.errors

        if self.container_id is None:
            return []
        log = self.flush() if final else None
        if final and log is None:
            self.stop()
        if log is None:
            try:
                log = self.client.api.logs(self.container_id, stdout=True, stderr=False)
            except docker.errors.APIError:
                return []
        return parse_access_log(log.decode("utf-8", "replace"))

    def flush(self) -> bytes | None:
        """Make squid refuse and log a marker request of the host's own (FLUSH_HOST, from a
        process run in its container), and wait until the marker is in the engine's copy of
        the log. squid logs a request when its transaction ends, which can come after the
        sandbox had its answer and exited, and the engine copies the log a little later
        still: a look at a running proxy once missed a refusal on a loaded machine. A
        sandbox that has ended closed its connections before the marker's was opened, squid
        handles them as they come, and its log and the engine's copy keep their order, so
        once the marker shows, everything the sandbox tried is there. About 0.2 s, where a
        stop takes about 2 s (squid's shutdown ticks once a second). Returns that log (its
        stdout); None when the marker did not show within FLUSH_TIMEOUT."""
        import docker.errors

        if self.container_id is None:
            return None
        marker = f"{secrets.token_hex(8)}.{FLUSH_HOST}"  # the host is what squid logs
        request = f"GET http://{marker}/ HTTP/1.0\r\n\r\n"
        give_up = time.monotonic() + FLUSH_TIMEOUT
        try:
            probe = self.client.api.exec_create(
                self.container_id, ["python3", "-I", "-S", "-c", FLUSH_PROBE, request]
            )
            self.client.api.exec_start(probe["Id"])
            while time.monotonic() < give_up:
                log = self.client.api.logs(self.container_id, stdout=True, stderr=False)
                if marker.encode() in log:
                    return log
                time.sleep(0.02)
        except docker.errors.APIError:
            return None
        return None

    def stop(self) -> None:
        """Stop squid (SIGTERM; it closes its connections, logging each, and exits), after
        which the engine has all of its log: about 2 s (squid's shutdown ticks once a
        second), so only where the log cannot be flushed (`flush`). Never raises."""
        import docker.errors

        if self.container_id is not None:
            with contextlib.suppress(docker.errors.APIError):
                self.client.api.stop(self.container_id, timeout=STOP_TIMEOUT)

    def remove(self, *, also: Callable[[], None] | None = None) -> None:
        """Remove the proxy (while `also` runs, e.g. the sandbox's removal), then the
        network; idempotent."""
        import docker.errors

        def remove_proxy() -> None:
            if self.container_id is not None:
                with contextlib.suppress(docker.errors.NotFound):
                    self.client.api.remove_container(self.container_id, force=True, v=True)

        worker = threading.Thread(target=remove_proxy, name="egress-remove")
        worker.start()
        try:
            if also is not None:
                also()
        finally:
            worker.join()
        remove_network(self.client, self.network_id)


def start_with_policy(api: docker.APIClient, container_id: str, config: dict[str, Any]) -> None:
    """Start an egress container (made with `stdin_open`, which sets StdinOnce) and write its
    policy to its stdin, as one JSON document, then end its input.

    Not an environment variable: the kernel caps one at 128 KiB (MAX_ARG_STRLEN), which a
    long allowlist passes; and the root filesystem is read-only (no copying a file in). The
    entrypoint reads to the end of input; an input cut short fails to parse, and the proxy
    refuses to start (fail closed). Raises the engine's errors; a proxy that exited before
    reading it all is left to `Egress.wait_ready`, which reports its log.
    """
    attached = api.attach_socket(container_id, params={"stdin": 1, "stream": 1})
    raw: socket.socket = attached._sock
    try:
        api.start(container_id)
        with contextlib.suppress(OSError):  # it exited: `wait_ready` says why
            raw.sendall(json.dumps(config).encode())
            raw.shutdown(socket.SHUT_WR)  # the end of its input (StdinOnce)
    finally:
        attached.close()
        raw.close()


def remove_network(client: docker.DockerClient, network_id: str) -> None:
    """Remove a run's network, first cutting off anything still attached to it (a container
    someone connected by hand, say), so that nothing keeps it alive; gone already is fine."""
    import docker.errors

    try:
        client.api.remove_network(network_id)
    except docker.errors.NotFound:
        return
    except docker.errors.APIError:
        with contextlib.suppress(docker.errors.NotFound):
            attached = client.api.inspect_network(network_id).get("Containers") or {}
            for container_id in attached:
                with contextlib.suppress(docker.errors.APIError):
                    client.api.disconnect_container_from_network(
                        container_id, network_id, force=True
                    )
            client.api.remove_network(network_id)


#: squid's error codes (`%err_code`) of an allowed request that failed upstream, as causes.
#: A tunnel goes through the SNI-checking hop, which hides its real error: squid then says
#: only that it could not forward it.
UPSTREAM_CAUSES = {
    "ERR_DNS_FAIL": "DNS failure upstream: the name does not resolve",
    "ERR_CONNECT_FAIL": "connection refused or unreachable upstream",
    "ERR_SECURE_CONNECT_FAIL": "TLS failure upstream",
    "ERR_CANNOT_FORWARD": "could not reach the host upstream (DNS failure, refused or "
    "unreachable connection)",
    "ERR_READ_ERROR": "connection to the host failed upstream (read error)",
    "ERR_WRITE_ERROR": "connection to the host failed upstream (write error)",
    "ERR_ZERO_SIZE_OBJECT": "the host closed the connection without an answer",
    "ERR_READ_TIMEOUT": "timed out upstream",
    "ERR_LIFETIME_EXP": "timed out upstream",
    "ERR_GATEWAY_FAILURE": "gateway failure upstream",
}
#: Error codes that are no failed attempt: the client went away, or nothing went wrong.
_NOT_FAILURES = frozenset({"-", "ERR_CLIENT_GONE", "ERR_NONE"})


def parse_access_log(text: str) -> list[dict[str, Any]]:
    """Every request in squid's access log (format `orchestrator`, see the template) that did
    not succeed, with its verdict and cause.

    Refused (`verdict: "denied"`): a request refused by the rules is `TCP_DENIED`; a tunnel
    whose TLS SNI was not on the allowlist shows up as `terminate` on the SNI-checking port.
    Allowed but failed (`verdict: "allowed"`): squid logged an error code (`UPSTREAM_CAUSES`).
    The SNI-checking hop's own lines (client 127.0.0.1) are squid's plumbing, not attempts.
    An event's `ts` is when the request started (squid logs at its end, and how long it took:
    a DNS lookup that fails slowly would otherwise fall into the agent's next step).
    """
    blocked = []
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) == 11:  # an image from before the duration was logged
            fields.append("0")
        if len(fields) != 12 or fields[0] != "ORCH":
            continue
        _, ts, client, method, host, port, status, squid_status, sni, bump, error, took = fields
        if host.endswith(f".{FLUSH_HOST}"):  # the host's own marker (`Egress.flush`)
            continue
        verdict = "denied"
        if "DENIED" in squid_status:
            reason = "not on the allowlist"
        elif bump == "terminate":
            reason = f"TLS server name {sni!r} not on the allowlist"
        elif client.startswith("127.") or error in _NOT_FAILURES:
            continue
        else:
            verdict = "allowed"
            reason = UPSTREAM_CAUSES.get(error, f"failed upstream ({error})")
            reason += f" (squid: HTTP {status}, {error})"
        event: dict[str, Any] = {
            "ts": float(ts) - (int(took) / 1000 if took.isdigit() else 0.0),
            "host": unquote(host),
            "port": int(port) if port.isdigit() else None,
            "method": method,
            "verdict": verdict,
            "reason": reason,
        }
        if sni != "-":
            event["sni"] = sni
        blocked.append(event)
    return blocked
