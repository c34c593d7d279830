"""The connection to the local Docker engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import docker.errors
from docker.utils.socket import frames_iter

from ...errors import EngineUnavailable

#: The API version a client speaks before it knows the engine's (every engine since 1.12
#: answers `/_ping` unversioned); the SDK's own floor.
PROBE_API_VERSION = "1.24"


def connect() -> docker.DockerClient:
    """A client for the local engine, at the engine's own API version, or a one-paragraph
    error saying how to get one.

    The version comes from `/_ping`'s `Api-Version` header, the same number the SDK's
    "auto" reads from `/version`: a round trip that fails as a ping would when no engine
    answers, but `/version` asks containerd for its components too, several times slower, at
    the start of every run (benchmarks/results/code_figures.md#engine-calls)."""
    try:
        client = docker.from_env(timeout=120, version=engine_api_version())
    except Exception as exc:  # the SDK raises several types for "no engine"
        raise EngineUnavailable(
            f"Cannot reach the Docker engine ({type(exc).__name__}: {exc}).",
            "Start Docker (`sudo systemctl start docker`, or `dockerd &`), check DOCKER_HOST, "
            "and make sure this user may use the socket (the `docker` group); nothing was "
            "started.",
        ) from exc
    return client


def engine_api_version() -> str:
    """The engine's API version (its `/_ping` says it); "auto" (the SDK asks `/version`)
    when the answer does not say. Raises what the SDK raises when no engine answers."""
    probe = docker.from_env(timeout=120, version=PROBE_API_VERSION)  # no round trip
    try:
        answer = probe.api.get(probe.api.base_url + "/_ping", timeout=120)
        answer.raise_for_status()
        return answer.headers.get("Api-Version") or "auto"
    finally:
        probe.close()


def stopped(client: docker.DockerClient, container_id: str, what: str, then: str) -> str | None:
    """None while a helper container of a run (egress proxy, model gateway) runs; else why
    the run lost it: `what` names it, `then` says what that cost the sandbox. An engine that
    hiccups is not evidence that the container is gone."""
    try:
        state = client.api.inspect_container(container_id)["State"]
    except docker.errors.NotFound:
        return f"the {what} container vanished during the run; {then}"
    except docker.errors.APIError:
        return None
    if state.get("Running"):
        return None
    return f"the {what} stopped during the run (exit code {state.get('ExitCode')}); {then}"


def attached_lines(socket: Any, max_line: int) -> Iterator[tuple[int, bytes]]:
    """(stream id, line) for each whole line a helper container (model gateway, secret
    interceptor) writes on its attached stdout (1) and stderr (2), each cut to `max_line`
    bytes; ends quietly when the socket is closed under it (the run is over)."""
    partial = {1: b"", 2: b""}
    with contextlib.suppress(OSError, ValueError):
        for stream_id, chunk in frames_iter(socket, tty=False):
            data = partial.get(stream_id, b"") + chunk
            *lines, rest = data.split(b"\n")
            partial[stream_id] = rest[-max_line:]
            for line in lines:
                yield stream_id, line[:max_line]


def remove_attached(client: docker.DockerClient, container_id: str, socket: Any) -> None:
    """Close a helper container's attached socket (if any) and remove it; idempotent."""
    if socket is not None:
        with contextlib.suppress(Exception):
            socket.close()
    with contextlib.suppress(docker.errors.NotFound):
        client.api.remove_container(container_id, force=True, v=True)


def inspect_image(client: docker.DockerClient, ref: str) -> dict[str, Any] | None:
    try:
        return client.api.inspect_image(ref)
    except docker.errors.ImageNotFound:
        return None


def engine_time(text: str | None) -> float | None:
    """The engine's RFC 3339 times (nanoseconds, `Z`) as epoch seconds; None for Docker's
    zero time or nothing."""
    if not text or text.startswith("0001-"):
        return None
    head, _, rest = text.rstrip("Z").partition(".")
    try:
        return datetime.fromisoformat(f"{head}.{(rest or '0')[:6]:0<6}+00:00").timestamp()
    except ValueError:
        return None
