"""The Docker side of the fake E2B cloud: one container per sandbox.

Everything here is blocking (docker SDK); the HTTP layer calls it from worker threads.
"""

from __future__ import annotations

import io
import os
import socket
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import docker
import docker.errors
from docker.utils.socket import frames_iter

LABEL = "e2b-test-server"
"""Label set to "1" on every container this server creates."""
LABEL_SANDBOX = "e2b-test-server.sandbox-id"
LABEL_INSTANCE = "e2b-test-server.instance"
LABEL_OWNER_PID = "e2b-test-server.pid"
LABEL_KEEP = "e2b-test-server.keep"
"""Set on images built with `keep_images=True`: orphan reaping leaves them alone."""

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

STDOUT = 1
STDERR = 2

# Runs before the user's command: enter the working directory, report the pid on stderr
# (the pid of this shell is the pid of the command, thanks to exec), then exec.
MARKER = "\x1ee2b-envd:"
_WRAPPER = (
    'cd -- "$1" 2>/dev/null || { printf "\\036e2b-envd:nocwd\\n" >&2; exit 126; }; '
    'shift; printf "\\036e2b-envd:pid %s\\n" "$$" >&2; exec "$@"'
)


class ContainerGone(Exception):
    """The sandbox's container no longer exists."""


@dataclass(frozen=True)
class UserInfo:
    """A user inside the sandbox, resolved from its /etc/passwd."""

    name: str
    uid: int
    gid: int
    home: str

    @property
    def docker_user(self) -> str:
        return f"{self.uid}:{self.gid}"


@dataclass(frozen=True)
class ExecResult:
    """Outcome of a short, buffered exec."""

    exit_code: int
    stdout: bytes
    stderr: bytes


def docker_client() -> docker.DockerClient:
    """A docker client with a pool large enough for many concurrent sandboxes."""
    return docker.DockerClient.from_env(max_pool_size=64)


def _raw_socket(sock: Any) -> socket.socket:
    return getattr(sock, "_sock", sock)


class ExecStream:
    """A started `docker exec` with its hijacked socket: demuxed output, optional stdin."""

    def __init__(self, api: docker.APIClient, exec_id: str, sock: Any, stdin: bool) -> None:
        self._api = api
        self.exec_id = exec_id
        self._sock = sock
        self.stdin_open = stdin

    def frames(self) -> Iterator[tuple[int, bytes]]:
        """Yield (stream, data) frames until the exec's output closes."""
        try:
            yield from frames_iter(self._sock, tty=False)
        except OSError:
            return

    def write_stdin(self, data: bytes) -> None:
        if not self.stdin_open:
            raise OSError("stdin not enabled or closed")
        _raw_socket(self._sock).sendall(data)

    def close_stdin(self) -> None:
        if self.stdin_open:
            self.stdin_open = False
            try:
                _raw_socket(self._sock).shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def exit_code(self, wait: float = 3.0) -> int | None:
        """The exec's exit code, waiting briefly for Docker to record it."""
        deadline = time.monotonic() + wait
        while True:
            try:
                info = self._api.exec_inspect(self.exec_id)
            except docker.errors.NotFound as e:
                raise ContainerGone(str(e)) from e
            except docker.errors.APIError as e:
                raise ContainerGone(str(e)) from e
            if not info.get("Running") and info.get("ExitCode") is not None:
                return int(info["ExitCode"])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class SandboxContainer:
    """One sandbox's container and the operations envd performs on it."""

    def __init__(self, client: docker.DockerClient, container_id: str, image: str) -> None:
        self._client = client
        self._api: docker.APIClient = client.api
        self.id = container_id
        self.image = image
        image_config = client.images.get(image).attrs.get("Config") or {}
        self.image_user: str = image_config.get("User") or ""
        self.image_workdir: str = image_config.get("WorkingDir") or ""
        self.image_path: str = next(
            (e.split("=", 1)[1] for e in image_config.get("Env") or [] if e.startswith("PATH=")),
            DEFAULT_PATH,
        )
        self._users: dict[str, UserInfo] = {}

    @classmethod
    def start(
        cls,
        client: docker.DockerClient,
        *,
        image: str,
        name: str,
        labels: Mapping[str, str],
        network_mode: str | None,
        options: Mapping[str, Any],
    ) -> SandboxContainer:
        """Create and start a long-lived container (sleep under an init) for a sandbox."""
        kwargs: dict[str, Any] = {
            "entrypoint": ["sleep", "infinity"],
            "command": [],
            "detach": True,
            "init": True,
            "name": name,
            "hostname": "e2b",
            "labels": dict(labels),
        }
        if network_mode:
            kwargs["network_mode"] = network_mode
        kwargs.update(options)
        container = client.containers.run(image, **kwargs)
        return cls(client, container.id, image)

    def remove(self) -> None:
        """Kill and remove the container; a missing container is not an error."""
        try:
            self._api.remove_container(self.id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                raise

    # -- processes -------------------------------------------------------------------

    def start_exec(
        self,
        argv: Sequence[str],
        *,
        user: UserInfo,
        cwd: str,
        env: Mapping[str, str],
        stdin: bool,
    ) -> ExecStream:
        """Start `argv` (through the pid-reporting wrapper) and return its live stream."""
        cmd = ["/bin/sh", "-c", _WRAPPER, "e2b-envd", cwd, *argv]
        try:
            created = self._api.exec_create(
                self.id,
                cmd,
                stdout=True,
                stderr=True,
                stdin=stdin,
                user=user.docker_user,
                environment=[f"{k}={v}" for k, v in env.items()],
            )
            sock = self._api.exec_start(created["Id"], socket=True)
        except docker.errors.NotFound as e:
            raise ContainerGone(str(e)) from e
        except docker.errors.APIError as e:
            if e.status_code in (404, 409):
                raise ContainerGone(str(e)) from e
            raise
        return ExecStream(self._api, created["Id"], sock, stdin)

    def run(
        self, argv: Sequence[str], *, user: str = "0:0", env: Mapping[str, str] | None = None
    ) -> ExecResult:
        """Run a short command to completion and buffer its output."""
        try:
            created = self._api.exec_create(
                self.id,
                list(argv),
                stdout=True,
                stderr=True,
                user=user,
                environment=[f"{k}={v}" for k, v in (env or {}).items()],
            )
            out, err = self._api.exec_start(created["Id"], demux=True)
            info = self._api.exec_inspect(created["Id"])
        except docker.errors.NotFound as e:
            raise ContainerGone(str(e)) from e
        except docker.errors.APIError as e:
            if e.status_code in (404, 409):
                raise ContainerGone(str(e)) from e
            raise
        return ExecResult(int(info.get("ExitCode") or 0), out or b"", err or b"")

    def start_background(
        self, argv: Sequence[str], *, user: UserInfo, cwd: str, env: Mapping[str, str]
    ) -> None:
        """Start a detached process (a template's start command) and return at once."""
        try:
            created = self._api.exec_create(
                self.id,
                list(argv),
                user=user.docker_user,
                workdir=cwd,
                environment=[f"{k}={v}" for k, v in env.items()],
            )
            self._api.exec_start(created["Id"], detach=True)
        except docker.errors.NotFound as e:
            raise ContainerGone(str(e)) from e

    def signal_group(self, pid: int, signal: str) -> None:
        """Send `signal` (e.g. "KILL") to the process group led by `pid`, then to `pid`."""
        script = f'kill -s {signal} -- -"$1" 2>/dev/null; kill -s {signal} "$1" 2>/dev/null; true'
        self.run(["/bin/sh", "-c", script, "kill", str(pid)])

    # -- users -----------------------------------------------------------------------

    def user_info(self, user: str) -> UserInfo:
        """Resolve a user name (or uid[:gid]) to its ids and home directory."""
        cached = self._users.get(user)
        if cached is not None:
            return cached
        name = user.split(":", 1)[0]
        result = self.run(["getent", "passwd", name])
        if result.exit_code == 0 and result.stdout:
            fields = result.stdout.decode().splitlines()[0].split(":")
            info = UserInfo(fields[0], int(fields[2]), int(fields[3]), fields[5] or "/")
        elif name.isdigit():
            gid = user.split(":", 1)[1] if ":" in user else name
            info = UserInfo(name, int(name), int(gid), "/")
        else:
            raise KeyError(user)
        self._users[user] = info
        return info

    # -- files -----------------------------------------------------------------------

    def put_files(self, files: Sequence[tuple[str, bytes]], owner: UserInfo) -> None:
        """Write absolute-path files owned by `owner`, creating parent directories as them."""
        parents = sorted({os.path.dirname(path) for path, _ in files})
        made = self.run(["mkdir", "-p", "--", *parents], user=owner.docker_user)
        if made.exit_code != 0:
            raise PermissionError(made.stderr.decode(errors="replace").strip())
        buffer = io.BytesIO()
        now = time.time()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for path, data in files:
                member = tarfile.TarInfo(path.lstrip("/"))
                member.size = len(data)
                member.mode = 0o644
                member.uid, member.gid = owner.uid, owner.gid
                member.mtime = int(now)
                tar.addfile(member, io.BytesIO(data))
        try:
            self._api.put_archive(self.id, "/", buffer.getvalue())
        except docker.errors.NotFound as e:
            raise ContainerGone(str(e)) from e

    def get_file(self, path: str) -> bytes:
        """Read one regular file; FileNotFoundError / IsADirectoryError as appropriate."""
        try:
            stream, stat = self._api.get_archive(self.id, path)
        except docker.errors.NotFound as e:
            if "No such container" in str(e):
                raise ContainerGone(str(e)) from e
            raise FileNotFoundError(path) from e
        if int(stat.get("mode", 0)) & (1 << 31):
            for _ in stream:
                pass
            raise IsADirectoryError(path)
        data = b"".join(stream)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar:
                extracted = tar.extractfile(member)
                if extracted is not None:
                    return extracted.read()
        raise FileNotFoundError(path)


def list_containers(client: docker.DockerClient, **labels: str) -> list[Any]:
    """All containers (running or not) carrying this server's label and `labels`. One
    removed between the engine's list and the SDK's inspect of each is left out, not an
    error (another server of the session removes its own meanwhile: a 404 failed a CI)."""
    filters = [f"{LABEL}=1", *(f"{k}={v}" for k, v in labels.items())]
    return client.containers.list(all=True, filters={"label": filters}, ignore_removed=True)


def reap_orphans(client: docker.DockerClient) -> int:
    """Remove containers left by test servers whose process is gone; return how many."""
    removed = 0
    for container in list_containers(client):
        owner = container.labels.get(LABEL_OWNER_PID, "")
        if owner.isdigit() and _pid_alive(int(owner)):
            continue
        try:
            container.remove(force=True)
            removed += 1
        except docker.errors.NotFound:
            pass
    return removed


def list_images(client: docker.DockerClient, *labels: str, all_layers: bool = True) -> list[Any]:
    """The images carrying every one of `labels` (`key=value`). One removed between the
    engine's list and the SDK's inspect of each is left out, not an error (another server of
    the session removes its own meanwhile: a 404 failed a CI)."""
    found = []
    for row in client.api.images(all=all_layers, filters={"label": list(labels)}):
        try:
            found.append(client.images.get(row["Id"]))
        except docker.errors.NotFound:
            continue
    return found


def remove_images(client: docker.DockerClient, keep: Callable[[Any], bool] | None = None) -> int:
    """Remove every image carrying this server's label (but those `keep` spares).

    Children go before their parents: an image with dependent children cannot be removed,
    so this makes passes until nothing more goes. Returns how many were removed.
    """
    removed = 0
    for _ in range(20):
        images = [i for i in list_images(client, f"{LABEL}=1") if keep is None or not keep(i)]
        progress = False
        for image in images:
            try:
                client.api.remove_image(image.id, force=True)
                removed += 1
                progress = True
            except docker.errors.NotFound:
                progress = True
            except docker.errors.APIError:
                continue  # has children (removed in a later pass) or is in use
        if not images or not progress:
            break
    return removed


def reap_orphan_images(client: docker.DockerClient) -> int:
    """Remove images built by test servers whose process is gone (unless kept)."""

    def keep(image: Any) -> bool:
        labels = image.labels or {}
        owner = labels.get(LABEL_OWNER_PID, "")
        return labels.get(LABEL_KEEP) == "1" or not owner.isdigit() or _pid_alive(int(owner))

    return remove_images(client, keep)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
