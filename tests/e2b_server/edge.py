"""E2B's edge for sandbox ports: `<port>-<sandbox id>.<domain>` reaches that port of the sandbox.

On E2B every sandbox port has a public host name (`Sandbox.get_host(port)`, "https://3000-
<id>.e2b.app"); its edge proxy routes a request by its `Host` to that port of that sandbox,
answers 502 when the sandbox is gone or nothing listens there, and, for a sandbox created with
`network.allow_public_traffic = False`, refuses (403) a request without the sandbox's
`e2b-traffic-access-token` header. Here:

- `Edge` (an ASGI app the test server mounts before envd and the control plane) does the same
  for requests whose `Host` is `<port>-<id>.<domain>` (any port of the server), forwarding to
  the container's address on its Docker network and streaming the answer back as it comes;
- `Resolver`, a small DNS server in a container of its own (one per test server), answers
  every name under `<domain>` with the test server's address on the sandboxes' network and
  relays every other question to the resolvers Docker gives containers, so that a sandbox (as
  on E2B, where public DNS resolves `*.e2b.app`) reaches another sandbox's port by that name.
  Sandbox containers get it as their only nameserver.

Not faithful: the edge speaks plain HTTP on the test server's port (E2B: HTTPS on 443), so a
client builds the URL from the SDK's sandbox URL (`E2B_SANDBOX_URL`: its scheme and port);
ports of sandboxes without internet access (`--network none` containers) cannot be reached
(502); the `Host` header reaches the service unchanged (`mask_request_host` is not applied).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import docker
import docker.errors
import httpx
from starlette.types import Receive, Scope, Send

if TYPE_CHECKING:
    from .cloud import FakeE2BCloud

#: The header E2B checks on sandboxes created with `allow_public_traffic = False`.
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
#: Not forwarded in either direction (RFC 9110 7.6.1), plus what the client sets again.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        TRAFFIC_TOKEN_HEADER,
    }
)

#: The resolver: a stdlib DNS server (runs in the base image's python3). A name under the
#: domain gets an A record with the edge's address (AAAA: no record); anything else is relayed
#: to the container's own nameservers, as Docker set them.
RESOLVER_SCRIPT = r"""
import socket, struct, sys, threading
domain, address = sys.argv[1].lower().encode(), socket.inet_aton(sys.argv[2])
upstreams = [l.split()[1] for l in open('/etc/resolv.conf') if l.startswith('nameserver')]
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(('0.0.0.0', 53))
def question(packet):
    i, labels = 12, []
    while packet[i]:
        labels.append(packet[i + 1:i + 1 + packet[i]])
        i += 1 + packet[i]
    return b'.'.join(labels).lower(), i + 1
def relay(packet, client):
    for server in upstreams:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as up:
                up.settimeout(2)
                up.sendto(packet, (server, 53))
                sock.sendto(up.recv(4096), client)
                return
        except OSError:
            continue
print('resolver ready', flush=True)
while True:
    packet, client = sock.recvfrom(4096)
    try:
        name, end = question(packet)
        qtype = struct.unpack('!H', packet[end:end + 2])[0]
    except (IndexError, struct.error):
        continue
    if name == domain or name.endswith(b'.' + domain):
        answer = b'\xc0\x0c' + struct.pack('!HHIH', 1, 1, 5, 4) + address if qtype == 1 else b''
        header = packet[:2] + struct.pack('!HHHHH', 0x8580, 1, 1 if answer else 0, 0, 0)
        sock.sendto(header + packet[12:end + 4] + answer, client)
    else:
        threading.Thread(target=relay, args=(packet, client), daemon=True).start()
"""


def network_gateway(client: docker.DockerClient, network: str | None) -> str:
    """This host's address on the sandboxes' Docker network (default bridge: docker0)."""
    info = client.api.inspect_network(network or "bridge")
    for config in info.get("IPAM", {}).get("Config") or []:
        if config.get("Gateway"):
            return str(config["Gateway"])
    if (network or "bridge") == "bridge":
        return "172.17.0.1"  # Docker 20.10 leaves the default bridge's Gateway out of IPAM
    raise RuntimeError(f"the Docker network {network} has no gateway address")


class Resolver:
    """The DNS server for `<domain>`, in a container of the test server's own."""

    def __init__(self) -> None:
        self.address: str | None = None
        self._container: Any = None

    def start(
        self,
        client: docker.DockerClient,
        *,
        image: str,
        network: str | None,
        domain: str,
        edge: str,
        labels: Mapping[str, str],
    ) -> str:
        """Start it (once) and return its address; raises RuntimeError if it will not."""
        if self.address is not None:
            return self.address
        container = client.containers.run(
            image,
            entrypoint=["python3", "-c", RESOLVER_SCRIPT, domain, edge],
            command=[],
            detach=True,
            name=f"e2b-test-resolver-{labels.get('e2b-test-server.instance', '')}",
            labels=dict(labels),
            network_mode=network or "bridge",
            user="root",
            cap_drop=["ALL"],
            cap_add=["NET_BIND_SERVICE"],
            read_only=True,
            mem_limit="64m",
        )
        self._container = container
        for _ in range(200):
            container.reload()
            if container.status != "running":
                break
            if b"resolver ready" in container.logs():
                networks = container.attrs["NetworkSettings"]["Networks"]
                self.address = str(next(iter(networks.values()))["IPAddress"])
                return self.address
            time.sleep(0.05)
        logs = container.logs().decode(errors="replace")
        self.stop()
        raise RuntimeError(f"the test server's DNS resolver did not start: {logs}")

    def stop(self) -> None:
        if self._container is not None:
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                self._container.remove(force=True)
        self._container = None
        self.address = None


class Edge:
    """Routes `<port>-<sandbox id>.<domain>` requests to that port of the sandbox."""

    def __init__(self, cloud: FakeE2BCloud) -> None:
        self.cloud = cloud
        self.pattern = re.compile(
            rf"^(\d{{1,5}})-([a-z0-9]+)\.{re.escape(cloud.domain)}(:\d+)?$", re.IGNORECASE
        )
        self._client: httpx.AsyncClient | None = None

    def route(self, host: str) -> tuple[int, str] | None:
        """(port, sandbox id) when `host` names a sandbox port, else None."""
        found = self.pattern.match(host.strip())
        return (int(found.group(1)), found.group(2).lower()) if found else None

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, port: int, sandbox_id: str
    ) -> None:
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        sandbox = self.cloud.running(sandbox_id)
        if sandbox is None or sandbox.container is None:
            await _reply(
                send,
                502,
                {"sandboxId": sandbox_id, "code": 502, "message": "The sandbox was not found"},
            )
            return
        if sandbox.traffic_access_token is not None:
            given = headers.get(TRAFFIC_TOKEN_HEADER)
            if given != sandbox.traffic_access_token:
                what = "is missing" if given is None else "is invalid"
                message = (
                    "Sandbox is secured with traffic access token. Token header "
                    f"'{TRAFFIC_TOKEN_HEADER}' {what}"
                )
                await _reply(send, 403, {"sandboxId": sandbox_id, "code": 403, "message": message})
                return
        address = self.cloud.container_address(sandbox)
        if address is None:
            await _reply(
                send,
                502,
                {
                    "sandboxId": sandbox_id,
                    "port": port,
                    "code": 502,
                    "message": "The sandbox has no network",
                },
            )
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self._client is None:
            timeout = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=30.0)
            self._client = httpx.AsyncClient(timeout=timeout, trust_env=False)
        target = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        query = scope.get("query_string") or b""
        url = f"http://{address}:{port}{target}" + (f"?{query.decode('latin-1')}" if query else "")
        forwarded = [
            (k, v) for k, v in scope.get("headers", []) if k.decode().lower() not in HOP_BY_HOP
        ]
        request = self._client.build_request(
            scope["method"], url, headers=forwarded, content=bytes(body)
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError:
            closed = "The sandbox is running but port is not open"
            await _reply(
                send, 502, {"sandboxId": sandbox_id, "port": port, "code": 502, "message": closed}
            )
            return
        try:
            out = [(k, v) for k, v in response.headers.raw if k.decode().lower() not in HOP_BY_HOP]
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": out}
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (httpx.HTTPError, OSError):
            pass  # the sandbox went away mid-answer: the answer ends here
        finally:
            await response.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _reply(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
