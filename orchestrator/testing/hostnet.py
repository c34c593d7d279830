"""This host's side of the egress checks: its own addresses, and a listener on all of them
that counts what arrives (the sandbox's failure to connect alone could be the probe's own)."""

from __future__ import annotations

import fcntl
import socket
import struct
import threading


def host_addresses(limit: int = 8) -> list[str]:
    """This host's IPv4 addresses, loopback left out (the sandbox's own loopback is its own):
    the bridge's gateway among them, which a Docker `--internal` network still reaches."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:
                continue
            address = socket.inet_ntoa(reply[20:24])
            if not address.startswith("127.") and address not in found:
                found.append(address)
    bridge_first = sorted(found, key=lambda a: (not a.startswith("172.17."), a))
    return bridge_first[:limit]


class Listener:
    """A TCP listener on every host address, counting connections (the host's side of
    "cannot reach the host": the probe's failure alone could be the probe's own)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("0.0.0.0", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                continue
            self.connections += 1
            client.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.close()
